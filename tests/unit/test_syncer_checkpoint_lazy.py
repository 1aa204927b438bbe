"""A checkpoint's tensors are read from its files one at a time (checkpoint.FileTensors): a
resume holds one checkpoint tensor beside the model, not the three files whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diloco_trainer.syncer.storage import checkpoint as ck


def _saved(tmp_path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weights = {"a": torch.randn(4, 5, generator=g), "b": torch.randn(7, generator=g)}
    ck.save_checkpoint(
        tmp_path,
        outer_step=1,
        weights=weights,
        momentum={"a": torch.ones(4, 5)},
        manifest={"versions": [1], "jobName": "unit"},
        keep=1,
    )
    return weights


def test_checkpoint_tensors_are_read_from_the_file_when_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = _saved(tmp_path)
    loaded = ck.load_latest(tmp_path)
    assert loaded is not None
    assert isinstance(loaded.weights, ck.FileTensors)
    assert sorted(loaded.weights) == ["a", "b"] and len(loaded.weights) == 2
    reads: list[str] = []
    real = ck.FileTensors.__getitem__

    def counting(self: ck.FileTensors, name: str) -> torch.Tensor:
        reads.append(name)
        return real(self, name)

    monkeypatch.setattr(ck.FileTensors, "__getitem__", counting)
    assert torch.equal(loaded.weights.pop("a"), weights["a"])
    assert reads == ["a"] and list(loaded.weights) == ["b"]
    with pytest.raises(KeyError):
        loaded.weights["a"]
    reads.clear()
    loaded.weights.clear()  # forgets without reading
    assert reads == [] and len(loaded.weights) == 0
    loaded.momentum["extra"] = torch.zeros(2)  # set: kept in memory
    assert sorted(loaded.momentum) == ["a", "extra"]
    assert torch.equal(loaded.momentum["extra"], torch.zeros(2))
