"""`diloco export` from checkpoints: the file loads into a fresh model with plain torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.cli import main as cli_main
from diloco_trainer.export import final_weights_note, find_checkpoint
from diloco_trainer.models.model import build_model
from diloco_trainer.models.parts import build_parts, evaluate
from diloco_trainer.syncer.storage import checkpoint as ckpt

SPEC = {"inner": {"batchSize": 4, "seqLen": 32}, "data": {"evalTokens": 1024}}


def _trained_weights(seed: int) -> dict[str, torch.Tensor]:
    """Weights of the job's model moved away from its initial values (as training would)."""
    parts = build_parts(parse_spec(SPEC), shard_index=0, num_shards=1, with_train=False)
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
        for n, p in parts.model.named_parameters()
    }


def _save(state_dir: Path, step: int, weights: dict[str, torch.Tensor], loss: float) -> Path:
    return ckpt.save_checkpoint(
        state_dir,
        outer_step=step,
        weights=weights,
        momentum={n: torch.zeros_like(t) for n, t in weights.items()},
        manifest={
            "jobName": "demo",
            "versions": [step, step],
            "evalHistory": [{"outerStep": step, "tokens": 10, "evalLoss": loss}],
        },
        keep=5,
    )


def test_export_checkpoint_loads_into_a_fresh_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = _trained_weights(1)
    _save(tmp_path, 3, _trained_weights(0), loss=5.0)
    _save(tmp_path, 6, weights, loss=4.25)
    out = tmp_path / "out" / "model.safetensors"
    assert cli_main(["export", str(tmp_path), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    # A user's side: the architecture, plain torch and safetensors, nothing of the job.
    model = build_model("gpt-tiny", 32)
    model.load_state_dict(safetensors.torch.load_file(out))  # strict: every name, every shape
    got = dict(model.named_parameters())
    assert all(torch.equal(got[n], weights[n]) for n in weights)
    parts = build_parts(parse_spec(SPEC), shard_index=0, num_shards=1, with_train=False)
    with torch.no_grad():
        for n, p in parts.model.named_parameters():
            p.copy_(weights[n])
    assert evaluate(parts, model) == evaluate(parts)
    with safetensors.safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["outerStep"] == "6" and meta["evalLoss"] == "4.25" and meta["job"] == "demo"
    assert meta["weights"] == "exact" and meta["versions"] == "[6, 6]"


def test_export_bfloat16_halves_the_file(tmp_path: Path) -> None:
    weights = _trained_weights(2)
    path = _save(tmp_path, 1, weights, loss=5.0)
    full, half = tmp_path / "full.safetensors", tmp_path / "half.safetensors"
    assert cli_main(["export", str(path), "-o", str(full)]) == 0
    assert cli_main(["export", str(path), "-o", str(half), "--dtype", "bfloat16"]) == 0
    loaded = safetensors.torch.load_file(half)
    assert {t.dtype for t in loaded.values()} == {torch.bfloat16}
    assert torch.equal(loaded["head.weight"], weights["head.weight"].bfloat16())
    assert half.stat().st_size < 0.6 * full.stat().st_size


def test_find_checkpoint_takes_the_newest_complete_one_and_only_reads(tmp_path: Path) -> None:
    weights = _trained_weights(3)
    _save(tmp_path, 2, weights, loss=5.0)
    newest = _save(tmp_path, 4, weights, loss=4.0)
    # What a syncer writing a checkpoint right now leaves: a hidden temporary directory.
    writing = tmp_path / ckpt.CHECKPOINTS_DIR / ".tmp-ckpt-abc"
    writing.mkdir()
    assert find_checkpoint(tmp_path) == newest
    assert find_checkpoint(tmp_path / ckpt.CHECKPOINTS_DIR) == newest
    older = tmp_path / ckpt.CHECKPOINTS_DIR / ckpt.checkpoint_name(2)
    assert find_checkpoint(older) == older
    assert writing.is_dir()  # export never cleans a live state dir


def test_export_without_a_checkpoint_or_token_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "m.safetensors")
    assert cli_main(["export", str(tmp_path), "-o", out]) == 1
    assert "holds no checkpoint" in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path / "missing"), "-o", out]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["export", "http://127.0.0.1:9", "-o", out, "--token-file", out]) == 1
    assert "cannot read token file" in capsys.readouterr().err
    assert not Path(out).exists()


def test_final_weights_note_names_the_checkpoint_and_the_command(tmp_path: Path) -> None:
    assert final_weights_note(tmp_path) is None
    path = _save(tmp_path, 5, _trained_weights(4), loss=4.0)
    note = final_weights_note(tmp_path)
    assert note is not None
    assert str(path) in note and f"diloco export {path} -o model.safetensors" in note


def test_export_with_config_writes_the_jobs_trained_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from diloco_trainer.models import data
    from diloco_trainer.models.data import load_corpus
    from tokenizers import Tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(24):
        (corpus / f"LICENSE-{i}").write_text(f"licence {i}: permission is hereby granted. " * 30)
    tokenizer = {"type": "bpe", "vocabSize": 300}
    job = tmp_path / "job.yaml"
    job.write_text(
        "kind: DiLoCoJob\nspec:\n"
        f"  data: {{source: {corpus}, tokenizer: {{type: bpe, vocabSize: 300}}}}\n"
    )
    state = tmp_path / "state"
    _save(state, 1, _trained_weights(5), loss=5.0)
    out = tmp_path / "model.safetensors"
    assert cli_main(["export", str(state), "-o", str(out), "--config", str(job)]) == 0
    written = tmp_path / "model.tokenizer.json"
    assert f"wrote {written}" in capsys.readouterr().out
    # The very tokenizer every process of the job trains (trained again here, not cached).
    data._CORPUS_CACHE.clear()
    job_corpus = load_corpus(
        str(corpus), tokenizer=parse_spec({"data": {"tokenizer": tokenizer}}).data.tokenizer
    )
    text = "licence 7: permission is hereby granted."
    ids = Tokenizer.from_file(str(written)).encode(text).ids
    assert ids == job_corpus.tokenizer.tok.encode(text).ids and len(ids) < len(text) / 2
    # Bytes need no file; a bad config is refused before anything is trained.
    plain = tmp_path / "plain.yaml"
    plain.write_text(f"data: {{source: {corpus}}}\n")
    args = ["export", str(state), "-o", str(tmp_path / "p.safetensors"), "--config", str(plain)]
    assert cli_main(args) == 0
    assert not (tmp_path / "p.tokenizer.json").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {tokenizer: {type: file}}\n")
    assert cli_main(["export", str(state), "-o", str(out), "--config", str(bad)]) == 2
    assert "spec.data.tokenizer" in capsys.readouterr().err
