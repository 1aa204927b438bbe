"""A learner's bodies built and read without safetensors' copies under the interpreter lock
(core/payloads.py encode_body_buffer, decode_body_unlocked): the bytes safetensors writes, the
tensors and metadata it reads, and its refusals."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from diloco_trainer.api.protocol import PushMeta
from diloco_trainer.core.payloads import decode_body, decode_body_unlocked, encode_body_buffer
from diloco_trainer.learner.push_encoding import encode_delta


def encoded_push() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    g = torch.Generator().manual_seed(0)
    delta = {"wte": torch.randn(300, 7, generator=g), "ln.b": torch.randn(5, generator=g)}
    meta = PushMeta(
        island="island-0",
        base_version=3,
        tokens=640,
        steps=5,
        loss=2.5,
        step_time=0.1,
        codec="int8",
        sync_time=1.5,
        push_id="abc",
    )
    return encode_delta(delta, "int8", None), meta.to_metadata()


def split(body: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(body[:8], "little")
    return json.loads(body[8 : 8 + n]), body[8 + n :]


def test_a_push_body_is_what_safetensors_writes() -> None:
    tensors, meta = encoded_push()
    ours = bytes(encode_body_buffer(tensors, meta))
    theirs = safetensors.torch.save(tensors, metadata=meta)
    # The same header (safetensors orders the metadata's keys as its hash map does) and data.
    assert len(ours) == len(theirs)
    assert split(ours) == split(theirs)


def test_a_body_read_unlocked_is_what_decode_body_reads() -> None:
    tensors, meta = encoded_push()
    body = safetensors.torch.save(tensors, metadata=meta)
    got, got_meta = decode_body_unlocked(body)
    want, want_meta = decode_body(body)
    assert got_meta == want_meta == meta
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    got["wte::q"].zero_()  # its own copy: the body, and what else reads it, are not written
    assert torch.equal(decode_body(body)[0]["wte::q"], want["wte::q"])


@pytest.mark.parametrize("cut", [4, 20, -3])
def test_a_malformed_body_is_refused_unlocked_too(cut: int) -> None:
    tensors, meta = encoded_push()
    body = safetensors.torch.save(tensors, metadata=meta)
    with pytest.raises(ValueError):
        decode_body_unlocked(body[:cut])
