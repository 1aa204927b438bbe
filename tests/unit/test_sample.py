"""`diloco sample`: the sampling rule (hand-derived probabilities), seeded determinism on a
freshly initialised model, the sources it reads (run folder, export file, export folder) and the
named errors (exit 2) for what it cannot sample."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import safetensors.torch
import torch
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.cli import main as cli_main
from diloco_trainer.models.model import build_model
from diloco_trainer.models.tokenizer import train_bpe
from diloco_trainer.sample import generate, next_token, token_probs
from diloco_trainer.syncer.storage import checkpoint as ckpt

SPEC = {"inner": {"batchSize": 4, "seqLen": 32}, "data": {"evalTokens": 1024}}


def test_token_probs_top_k_and_temperature_by_hand() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0])
    # top-k 2 at temperature 1: id 0 is out; the rest is softmax([3, 2]) = [e, 1] / (e + 1).
    e = math.e
    assert token_probs(logits, 1.0, 2).tolist() == pytest.approx([0.0, e / (e + 1), 1 / (e + 1)])
    # temperature 2, all tokens: softmax([0.5, 1.5, 1.0]).
    w = [math.exp(0.5), math.exp(1.5), math.exp(1.0)]
    assert token_probs(logits, 2.0, 0).tolist() == pytest.approx([x / sum(w) for x in w])
    # top-k 1 leaves only the largest: probability 1.
    assert token_probs(logits, 5.0, 1).tolist() == [0.0, 1.0, 0.0]
    # top-k at or above the vocabulary is no restriction.
    assert torch.equal(token_probs(logits, 1.0, 3), token_probs(logits, 1.0, 0))


def test_next_token_greedy_and_top_k() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    g = torch.Generator().manual_seed(0)
    assert next_token(logits, 0.0, 40, g) == 1  # temperature 0: the argmax, whatever k
    draws = [next_token(logits, 1.0, 2, g) for _ in range(2000)]
    assert set(draws) == {1, 2}  # only the two largest are ever drawn
    # Their frequency is e/(e+1) = 0.731 (a fixed seed: the count is the same every run).
    assert draws.count(1) / len(draws) == pytest.approx(math.e / (math.e + 1), abs=0.03)


def _tiny_model(seed: int = 0, vocab: int = 256) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("gpt-tiny", 32, vocab).eval()


def test_generate_is_deterministic_with_a_seed() -> None:
    model = _tiny_model()
    prompt = list(b"def ")
    a = generate(model, prompt, 24, block_size=32, temperature=1.0, top_k=0, seed=3)
    b = generate(model, prompt, 24, block_size=32, temperature=1.0, top_k=0, seed=3)
    c = generate(model, prompt, 24, block_size=32, temperature=1.0, top_k=0, seed=4)
    assert a == b and len(a) == 24 and all(0 <= t < 256 for t in a)
    assert a != c  # a fresh model is near uniform over 256 bytes: two seeds part at once


def test_generate_greedy_follows_the_argmax_past_the_context() -> None:
    model = _tiny_model(1)
    prompt = list(range(40))  # longer than block_size 32: the context is its last 32 tokens
    got = generate(model, prompt, 10, block_size=32, temperature=0.0, seed=0)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(model(torch.tensor([ids[-32:]]))[0, -1].argmax()))
    assert got == ids[40:]
    # top-k 1 at any temperature is greedy too.
    assert generate(model, prompt, 10, block_size=32, temperature=2.0, top_k=1, seed=9) == got


def _run_folder(tmp_path: Path, spec: dict[str, object], *, weights: bool = True) -> Path:
    """A run folder as `diloco run` leaves it: spec.json, syncer/ with a checkpoint."""
    folder = tmp_path / "runs" / "demo"
    (folder / "syncer").mkdir(parents=True)
    (folder / "spec.json").write_text(parse_spec(spec).to_json())
    if weights:
        model = _tiny_model(2)
        named = {n: p.detach() for n, p in model.named_parameters()}
        ckpt.save_checkpoint(
            folder / "syncer",
            outer_step=4,
            weights=named,
            momentum={n: torch.zeros_like(t) for n, t in named.items()},
            manifest={"jobName": "demo", "versions": [4], "evalHistory": []},
            keep=2,
        )
    return folder


def _sample(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli_main(["sample", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_run_folder_and_its_export_sample_the_same_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _run_folder(tmp_path, SPEC)
    args = ["--prompt", "import ", "--tokens", "30", "--seed", "5"]
    code, from_folder, err = _sample([str(folder), *args], capsys)
    assert code == 0, err
    assert from_folder.startswith("import ") and "gpt-tiny" in err and "ckpt-" in err
    model_file = tmp_path / "out" / "model.safetensors"
    assert cli_main(["export", str(folder), "-o", str(model_file)]) == 0
    capsys.readouterr()
    code, from_file, err = _sample([str(model_file), *args], capsys)
    assert code == 0, err
    assert from_file == from_folder
    # The folder `diloco export` wrote into (one export file in it) is a source too.
    code, from_dir, err = _sample([str(model_file.parent), *args], capsys)
    assert (code, from_dir) == (0, from_folder), err
    # Greedy: every run the same text whatever the seed.
    greedy = [_sample([str(folder), "--temperature", "0", "--seed", s], capsys)[1] for s in "12"]
    assert greedy[0] == greedy[1]


def test_subword_tokenizer_beside_the_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = [b"the cat sat on the mat", b"the dog sat on the log"] * 20
    tok = train_bpe(docs, 300)
    spec = parse_spec({**SPEC, "data": {"tokenizer": {"type": "bpe", "vocabSize": 300}}})
    model = _tiny_model(3, tok.vocab_size)
    out = tmp_path / "model.safetensors"
    safetensors.torch.save_file(
        {n: p.detach().contiguous() for n, p in model.named_parameters()},
        str(out),
        metadata={"spec": spec.to_json(), "preset": "gpt-tiny"},
    )
    tok.save(tmp_path / "model.tokenizer.json")
    code, text, err = _sample([str(out), "--prompt", "the cat", "--tokens", "8"], capsys)
    assert code == 0, err
    assert "tokens: bpe" in err
    # The prompt encoded and the draws decoded by the job's tokenizer, not bytes.
    prompt = tok.tok.encode("the cat", add_special_tokens=False).ids
    ids = generate(model, prompt, 8, block_size=32, temperature=0.8, top_k=40, seed=0)
    assert text == "the cat" + tok.decode(ids) + "\n"


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        ("no-weights", "holds no weights"),
        ("entrypoint", "model.entrypoint"),
        ("missing", "does not exist"),
        ("no-spec-metadata", "does not record its job"),
        ("two-exports", "several export files"),
        ("not-safetensors", "is not a safetensors file"),
    ],
)
def test_what_cannot_be_sampled_is_named_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, needle: str
) -> None:
    source = tmp_path / "src"
    if setup == "no-weights":
        source = _run_folder(tmp_path, SPEC, weights=False)
    elif setup == "entrypoint":
        source = _run_folder(tmp_path, {**SPEC, "model": {"entrypoint": "my_model:parts"}})
    elif setup in ("no-spec-metadata", "two-exports"):
        source.mkdir()
        weights = {n: p.detach() for n, p in _tiny_model().named_parameters()}
        safetensors.torch.save_file(weights, str(source / "a.safetensors"))
        if setup == "two-exports":
            safetensors.torch.save_file(weights, str(source / "b.safetensors"))
    elif setup == "not-safetensors":
        source = tmp_path / "model.safetensors"
        source.write_text("not a model")
    code, out, err = _sample([str(source)], capsys)
    assert (code, out) == (2, "")
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("flag", "value"), [("--tokens", "0"), ("--temperature", "-1"), ("--top-k", "-2")]
)
def test_bad_flags_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    folder = _run_folder(tmp_path, SPEC)
    code, _, err = _sample([str(folder), flag, value], capsys)
    assert code == 2 and flag in err


def test_export_metadata_spec_is_json(tmp_path: Path) -> None:
    # What the export-file source relies on: `diloco export` of a run folder records the spec.
    folder = _run_folder(tmp_path, SPEC)
    out = tmp_path / "m.safetensors"
    assert cli_main(["export", str(folder), "-o", str(out)]) == 0
    with safetensors.safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["spec"])["inner"]["seqLen"] == 32
