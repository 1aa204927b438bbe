"""The first release's `from diloco_trainer.data import Batch` still works, with a warning."""

from __future__ import annotations

import subprocess
import sys

IMPORT = "from diloco_trainer.data import Batch, TokenStream; print(Batch.__module__)"


def test_old_data_import_works_and_warns() -> None:
    shown = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", "-c", IMPORT],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert shown.stdout.strip() == "diloco_trainer.models.data"  # the very same class
    assert "DeprecationWarning: diloco_trainer.data is deprecated" in shown.stderr
    assert "diloco_trainer.parts" in shown.stderr
    refused = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", IMPORT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1 and "DeprecationWarning" in refused.stderr
