"""Corpora, eval split, sharded token streams and their exact resumption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diloco_trainer.api.spec import ConfigError
from diloco_trainer.models.data import (
    BUILTIN_STDLIB,
    TokenStream,
    eval_batches,
    load_corpus,
)


def _stream(data: torch.Tensor, **kw: int) -> TokenStream:
    args = {"shard_index": 0, "num_shards": 1, "batch_size": 4, "seq_len": 8, "seed": 0}
    args.update(kw)
    return TokenStream(data, **args)


def _byte_ramp(n: int) -> torch.Tensor:
    # Each value is its own position mod 251, so windows reveal where they came from.
    return (torch.arange(n) % 251).to(torch.uint8)


def test_load_corpus_stdlib_is_deterministic_and_split() -> None:
    a = load_corpus(BUILTIN_STDLIB)
    assert a.documents > 100
    assert a.train.dtype == torch.uint8
    assert a.train.numel() > 1_000_000
    # About one tenth of the files are held out.
    assert 0.03 < a.eval.numel() / (a.train.numel() + a.eval.numel()) < 0.3
    assert load_corpus(BUILTIN_STDLIB) is a  # cached per process


def test_load_corpus_directory_holds_out_whole_files(tmp_path: Path) -> None:
    for i in range(30):
        sub = tmp_path / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:02d}.txt").write_text(f"<file {i:02d}>" * 20)
    (tmp_path / "image.png").write_bytes(b"\x89PNG not text")
    corpus = load_corpus(str(tmp_path))
    assert corpus.documents == 30
    train, held = bytes(corpus.train.tolist()), bytes(corpus.eval.tolist())
    assert b"PNG" not in train + held
    held_files = {i for i in range(30) if f"<file {i:02d}>".encode() in held}
    train_files = {i for i in range(30) if f"<file {i:02d}>".encode() in train}
    assert held_files and not held_files & train_files
    assert held_files | train_files == set(range(30))


def test_load_corpus_single_file_holds_out_tail(tmp_path: Path) -> None:
    f = tmp_path / "book.txt"
    f.write_bytes(bytes(range(256)) * 40)
    corpus = load_corpus(str(f))
    assert corpus.train.numel() + corpus.eval.numel() == 256 * 40
    assert corpus.eval.numel() == int(256 * 40 * 0.1)
    assert torch.equal(corpus.eval, torch.tensor(list(bytes(range(256)) * 40))[-1024:].byte())


def test_load_corpus_missing_path_names_data_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data\.source"):
        load_corpus(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"data\.source"):
        load_corpus("builtin:nothing")


def test_token_stream_targets_are_inputs_shifted() -> None:
    s = _stream(_byte_ramp(10_000))
    b = s.next_batch()
    assert b.inputs.shape == b.targets.shape == (4, 8)
    assert b.inputs.dtype == torch.long
    assert b.tokens == 32
    assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
    assert torch.equal(b.targets, (b.inputs + 1) % 251)


def test_token_stream_shards_and_ranks_are_disjoint() -> None:
    n = 4 * 2 * 100
    data = torch.arange(n, dtype=torch.int64)  # unique values: reveals every position read
    seen: dict[tuple[int, int], set[int]] = {}
    for shard in range(4):
        for rank in range(2):
            s = TokenStream(
                data,
                shard_index=shard,
                num_shards=4,
                rank=rank,
                world_size=2,
                batch_size=3,
                seq_len=9,
                seed=1,
            )
            vals: set[int] = set()
            for _ in range(10):
                b = s.next_batch()
                vals |= set(b.inputs.flatten().tolist()) | set(b.targets.flatten().tolist())
            seen[(shard, rank)] = vals
            part = shard * 2 + rank
            assert min(vals) >= part * 100 and max(vals) < (part + 1) * 100
    keys = list(seen)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            assert not seen[a] & seen[b]


def test_token_stream_epoch_visits_every_window_once() -> None:
    s = _stream(torch.arange(8 * 12 + 1), batch_size=4, seq_len=8)
    assert s.windows == 12
    starts = [int(x) for _ in range(3) for x in s.next_batch().inputs[:, 0]]
    assert sorted(starts) == [8 * k for k in range(12)]
    next_epoch = [int(x) for _ in range(3) for x in s.next_batch().inputs[:, 0]]
    assert sorted(next_epoch) == sorted(starts)
    assert next_epoch != starts  # reshuffled


def test_token_stream_resumes_exactly_from_state_dict() -> None:
    data = _byte_ramp(50_000)
    a = _stream(data, seed=3)
    for _ in range(5):
        a.next_batch()
    state = a.state_dict()
    assert state["tokens_consumed"] == 5 * 4 * 8 == a.tokens_consumed
    expected = [a.next_batch() for _ in range(4)]
    b = _stream(data, seed=3)
    b.load_state_dict(state)
    for want in expected:
        got = b.next_batch()
        assert torch.equal(got.inputs, want.inputs)
    assert b.tokens_consumed == a.tokens_consumed


def test_token_stream_seed_changes_order() -> None:
    data = _byte_ramp(50_000)
    a, b = _stream(data, seed=0), _stream(data, seed=1)
    assert not torch.equal(a.next_batch().inputs, b.next_batch().inputs)


def test_token_stream_too_small_corpus_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"too few for 8 shards"):
        _stream(_byte_ramp(60), num_shards=8, seq_len=8)


def test_token_stream_rejects_bad_shard_and_rank() -> None:
    with pytest.raises(ValueError, match="shard_index 2"):
        _stream(_byte_ramp(1000), shard_index=2, num_shards=2)
    with pytest.raises(ValueError, match="rank 1"):
        _stream(_byte_ramp(1000), rank=1, world_size=1)


def test_eval_batches_are_fixed_and_total_eval_tokens() -> None:
    data = _byte_ramp(20_000)
    a = eval_batches(data, eval_tokens=1000, batch_size=16, seq_len=32)
    b = eval_batches(data, eval_tokens=1000, batch_size=16, seq_len=32)
    assert sum(x.tokens for x in a) == 32 * 32  # ceil(1000/32) = 32 windows
    assert [x.inputs.shape[0] for x in a] == [16, 16]
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(a, b, strict=True))
    assert all(torch.equal(x.targets, (x.inputs + 1) % 251) for x in a)


def test_eval_batches_too_small_split_names_data_source() -> None:
    with pytest.raises(ConfigError, match=r"data\.source.*eval split"):
        eval_batches(_byte_ramp(10), eval_tokens=1024, batch_size=4, seq_len=16)
