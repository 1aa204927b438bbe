"""Corpora, eval split, sharded token streams and their exact resumption."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diloco_trainer.api.spec import ConfigError, TokenizerSpec, parse_spec
from diloco_trainer.models.data import (
    BUILTIN_STDLIB,
    TokenStream,
    eval_batches,
    load_corpus,
    resume_position,
)
from diloco_trainer.models.parts import build_parts
from diloco_trainer.models.tokenizer import SubwordTokenizer


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
    text = bytes(range(1, 128)) * 80  # ASCII: a file named by data.source must be text
    f.write_bytes(text)
    corpus = load_corpus(str(f))
    assert corpus.train.numel() + corpus.eval.numel() == len(text)
    held = int(len(text) * 0.1)
    assert corpus.eval.numel() == held
    assert torch.equal(corpus.eval, torch.tensor(list(text))[-held:].byte())


def test_load_corpus_refuses_a_binary_file_named_as_the_source(tmp_path: Path) -> None:
    f = tmp_path / "program"
    f.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    with pytest.raises(ConfigError, match=r"^data\.source: .*program is not text \(binary: NUL"):
        load_corpus(str(f))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.txt is not text \(not UTF-8 \(byte 3\)\)"):
        load_corpus(str(tmp_path / "latin1.txt"))


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


def test_resume_position_counts_a_ranks_windows() -> None:
    # 10,000 island tokens of 64-token windows over 2 ranks: 78.125 windows a rank, 78 taken.
    assert resume_position(10_000, seq_len=64, world_size=2) == 78
    assert resume_position(10_000, seq_len=64, world_size=1) == 156
    assert resume_position(0, seq_len=64, world_size=4) == 0
    with pytest.raises(ValueError):
        resume_position(-1, seq_len=64, world_size=1)


def test_a_rank_resumed_at_its_islands_tokens_takes_the_next_windows() -> None:
    """Two ranks of an island train 3 steps (batch 4 x seqLen 8: 2 x 3 x 32 = 192 island
    tokens); a restarted rank seeks to resume_position(192) = 12 windows and takes exactly the
    batch the original rank 1 takes next."""
    data = _byte_ramp(50_000)
    ranks = [_stream(data, seed=5, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        for stream in ranks:
            stream.next_batch()
    island_tokens = sum(stream.tokens_consumed for stream in ranks)
    assert island_tokens == 192
    restarted = _stream(data, seed=5, rank=1, world_size=2)
    position = resume_position(island_tokens, seq_len=8, world_size=2)
    assert position == 12
    restarted.load_state_dict({"position": position, "tokens_consumed": position * 8})
    assert torch.equal(restarted.next_batch().inputs, ranks[1].next_batch().inputs)


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


# -- sources: text by content, include patterns, JSON Lines, Parquet ------------------------------

LICENSE_TEXT = "Permission is hereby granted, free of charge, to any person obtaining a copy. "


def _license_dir(root: Path, n: int = 24) -> Path:
    """A directory of extensionless license texts (as named in SPDX: Apache-2.0, GPL-3, ...)."""
    root.mkdir(exist_ok=True)
    for i in range(n):
        (root / f"License-{i:02d}").write_text(f"<license {i:02d}> " + LICENSE_TEXT * 20)
    return root


def test_load_corpus_reads_extensionless_text_and_says_what_it_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _license_dir(tmp_path)
    (tmp_path / "Apache-2.0").write_text("Apache License\nVersion 2.0, January 2004\n" * 50)
    (tmp_path / "logo").write_bytes(b"GIF89a\x00\x01\x02")
    (tmp_path / "latin1").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (tmp_path / "empty").write_bytes(b"")
    with caplog.at_level("INFO", logger="diloco.data"):
        corpus = load_corpus(str(tmp_path))
    assert corpus.documents == 25
    everything = bytes(corpus.train.tolist()) + bytes(corpus.eval.tolist())
    assert b"Apache License" in everything and b"GIF89a" not in everything
    assert b"caf" not in everything
    assert "read 25 file(s)" in corpus.report
    assert "logo (binary: NUL byte)" in corpus.report
    assert "latin1 (not UTF-8 (byte 3))" in corpus.report
    assert "empty (empty)" in corpus.report
    assert corpus.report in caplog.text


def test_load_corpus_no_text_names_every_skipped_file(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"\x00\x01")
    (tmp_path / "b.bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"data\.source: .* contains no text") as err:
        load_corpus(str(tmp_path))
    assert "a.bin (binary: NUL byte)" in str(err.value)
    assert "b.bin (binary: NUL byte)" in str(err.value)


def test_load_corpus_include_patterns_choose_files(tmp_path: Path) -> None:
    _license_dir(tmp_path)
    (tmp_path / "notes.md").write_text("# notes\n" * 100)
    sub = tmp_path / "more"
    sub.mkdir()
    (sub / "GPL-3").write_text("GNU GENERAL PUBLIC LICENSE\n" * 100)
    by_name = load_corpus(str(tmp_path), include=["GPL-*", "notes.*"])
    assert by_name.documents == 2
    by_path = load_corpus(str(tmp_path), include=["more/*"])
    assert by_path.documents == 1
    assert b"GNU GENERAL" in bytes(by_path.train.tolist())
    with pytest.raises(ConfigError, match=r"not chosen by data\.include \['\*\.txt'\]"):
        load_corpus(str(tmp_path), include=["*.txt"])


def _records(n: int) -> list[dict[str, object]]:
    return [{"id": i, "text": f"<record {i:03d}> " + "the quick brown fox " * 10} for i in range(n)]


def test_load_corpus_jsonl_records_are_documents(tmp_path: Path) -> None:
    import gzip
    import json

    lines = [json.dumps(r) for r in _records(30)] + ["", json.dumps({"id": 99, "title": "x"})]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:15]) + "\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("\n".join(lines[15:]) + "\n")
    corpus = load_corpus(str(tmp_path))
    assert corpus.documents == 30
    held = bytes(corpus.eval.tolist())
    train = bytes(corpus.train.tolist())
    held_ids = {i for i in range(30) if f"<record {i:03d}>".encode() in held}
    assert held_ids == {5, 15, 25}  # every 10th record held out whole
    assert b'"id"' not in train + held  # only the text field is read
    assert "b.jsonl.gz (15 jsonl records, 1 without 'text')" in corpus.report


def test_load_corpus_jsonl_errors_name_field_and_line(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(ConfigError, match=r"data\.source: .*bad\.jsonl line 2 is not JSON"):
        load_corpus(str(tmp_path))
    other = tmp_path / "other"
    other.mkdir()
    (other / "c.jsonl").write_text('{"content": "a"}\n')
    with pytest.raises(ConfigError, match=r"c\.jsonl \(no record .*'body' \(data\.textField\)"):
        load_corpus(str(other), text_field="body")


def test_load_corpus_format_jsonl_reads_any_suffix(tmp_path: Path) -> None:
    import json

    (tmp_path / "dump.txt").write_text("\n".join(json.dumps(r) for r in _records(25)))
    as_text = load_corpus(str(tmp_path))
    as_jsonl = load_corpus(str(tmp_path), fmt="jsonl")
    assert as_text.documents == 1 and as_jsonl.documents == 25


def test_load_corpus_parquet_text_column(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = _records(40)
    table = pa.table(
        {"id": [r["id"] for r in records], "body": [r["text"] for r in records[:-1]] + [None]}
    )
    pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=7)
    corpus = load_corpus(str(tmp_path), text_field="body")
    assert corpus.documents == 39
    assert "(39 parquet records, 1 without 'body')" in corpus.report
    everything = bytes(corpus.train.tolist()) + bytes(corpus.eval.tolist())
    assert all(f"<record {i:03d}>".encode() in everything for i in range(39))
    with pytest.raises(
        ConfigError, match=r"data\.textField: .*part-0\.parquet has no column 'text'"
    ):
        load_corpus(str(tmp_path))


# -- tokenizers --------------------------------------------------------------------------------


def test_bpe_tokenizer_is_trained_on_train_split_and_sets_vocab(tmp_path: Path) -> None:
    _license_dir(tmp_path, n=30)
    spec = TokenizerSpec(type="bpe", vocab_size=300)
    corpus = load_corpus(str(tmp_path), tokenizer=spec)
    assert corpus.vocab_size == 300
    assert corpus.train.dtype == torch.int32
    assert int(corpus.train.min()) >= 0 and int(corpus.train.max()) < 300
    by_bytes = load_corpus(str(tmp_path))
    assert corpus.train.numel() < by_bytes.train.numel() / 2  # merges shorten the text
    assert isinstance(corpus.tokenizer, SubwordTokenizer)
    assert "<license 00>" in corpus.tokenizer.decode(corpus.train[:40].tolist())


def test_bpe_training_is_identical_in_separate_processes(tmp_path: Path) -> None:
    # The syncer and every learner train their own BPE: they must all get the same one. The
    # child processes import no torch (a quick start): reading and training need none.
    _license_dir(tmp_path, n=30)
    (tmp_path / "python").write_text(Path(__file__).read_text())
    script = (
        "import sys, hashlib\n"
        "from diloco_trainer.models.sources import read_source, split_documents\n"
        "from diloco_trainer.models.tokenizer import train_bpe\n"
        "train, _ = split_documents(read_source(sys.argv[1]).docs)\n"
        "print(hashlib.sha256(train_bpe(train, 600).tok.to_str().encode()).hexdigest())\n"
        "assert 'torch' not in sys.modules\n"
    )
    here = load_corpus(str(tmp_path), tokenizer=TokenizerSpec(type="bpe", vocab_size=600))
    assert isinstance(here.tokenizer, SubwordTokenizer)
    digests = {hashlib.sha256(here.tokenizer.tok.to_str().encode()).hexdigest()}
    for seed in (1, 2):
        child = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        )
        assert child.returncode == 0, child.stderr
        digests.add(child.stdout.strip())
    assert len(digests) == 1


def test_tokenizer_file_is_used_and_errors_name_the_path(tmp_path: Path) -> None:
    corpus_dir = _license_dir(tmp_path / "corpus")
    bpe = load_corpus(str(corpus_dir), tokenizer=TokenizerSpec(type="bpe", vocab_size=280))
    assert isinstance(bpe.tokenizer, SubwordTokenizer)
    tok_file = tmp_path / "tokenizer.json"
    bpe.tokenizer.save(tok_file)
    from_file = load_corpus(
        str(corpus_dir), tokenizer=TokenizerSpec(type="file", path=str(tok_file))
    )
    assert from_file.vocab_size == 280
    assert torch.equal(from_file.train, bpe.train) and torch.equal(from_file.eval, bpe.eval)
    missing = TokenizerSpec(type="file", path=str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match=r"data\.tokenizer\.path: .*nope\.json"):
        load_corpus(str(corpus_dir), tokenizer=missing)
    (tmp_path / "garbage.json").write_text("{}")
    garbage = TokenizerSpec(type="file", path=str(tmp_path / "garbage.json"))
    with pytest.raises(ConfigError, match=r"data\.tokenizer\.path: .*garbage\.json is not a tok"):
        load_corpus(str(corpus_dir), tokenizer=garbage)


def test_tokenizer_spec_needs_path_exactly_with_file() -> None:
    with pytest.raises(ConfigError, match=r"spec\.data\.tokenizer: .*path is required"):
        parse_spec({"data": {"tokenizer": {"type": "file"}}})
    with pytest.raises(ConfigError, match=r"spec\.data\.tokenizer: .*path is required"):
        parse_spec({"data": {"tokenizer": {"type": "bpe", "path": "/x.json"}}})
    with pytest.raises(ConfigError, match=r"spec\.data\.tokenizer\.vocabSize"):
        parse_spec({"data": {"tokenizer": {"type": "bpe", "vocabSize": 100}}})


def test_build_parts_model_vocabulary_follows_the_tokenizer(tmp_path: Path) -> None:
    _license_dir(tmp_path, n=30)
    spec = parse_spec(
        {
            "data": {
                "source": str(tmp_path),
                "evalTokens": 1024,
                "tokenizer": {"type": "bpe", "vocabSize": 320},
            },
            "inner": {"batchSize": 2, "seqLen": 16},
        }
    )
    parts = build_parts(spec, shard_index=0, num_shards=2)
    assert parts.model.tok_emb.weight.shape[0] == 320
    assert parts.model.head.weight.shape[0] == 320
    assert parts.train is not None
    loss = parts.loss_fn(parts.model, parts.train.next_batch())
    assert loss.item() == pytest.approx(math.log(320), abs=0.3)
    # The same seed gives the same weights whatever the tokenizer costs in RNG draws.
    again = build_parts(spec, shard_index=1, num_shards=2, with_train=False)
    assert torch.equal(again.model.head.weight, parts.model.head.weight)
