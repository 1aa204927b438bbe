"""Unit tier: pure logic, seconds. One torch thread: on a shared 2-core machine more is slower."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _single_torch_thread() -> None:
    try:
        import torch
    except ImportError:  # the operator-only install has no torch; its tests need none
        return
    torch.set_num_threads(1)
