"""Pull bodies built by torch copies (payloads.encode_body_buffer, encode_update_chain_buffer):
the same tensors, metadata and data bytes as safetensors' own serialiser gives, for every dtype
a body holds, views and empty tensors included."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from diloco_trainer.core import payloads
from diloco_trainer.core.compress import encode_tensors


def _header_length(body: bytes) -> int:
    return int.from_bytes(body[:8], "little")


def test_pull_body_matches_safetensors_data_and_decodes_the_same() -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, 8, generator=g)
    tensors = {
        "w": torch.randn(3, 4, generator=g),
        "view": base[:, :3],  # not contiguous: copied as its values
        "empty": torch.zeros(0),
        "half": torch.randn(5, generator=g).half(),
        "bf": torch.randn(5, generator=g).bfloat16(),
        **encode_tensors({"q": torch.randn(6, 7, generator=g)}, "int8"),
    }
    meta = {"kind": "full", "version": 3, "finished": False}
    built = payloads.encode_body_buffer(tensors, meta)
    reference = payloads.encode_body(tensors, meta)
    assert isinstance(built, memoryview) and built.readonly and len(built) == len(reference)
    # The tensors' bytes are laid out as safetensors lays them out (its metadata's key order
    # is a hash map's, so the headers may differ in that order only).
    assert built[8 + _header_length(bytes(built)) :] == reference[8 + _header_length(reference) :]
    assert _header_length(bytes(built)) % 8 == 0
    got, got_meta = payloads.decode_body(built)
    want, want_meta = payloads.decode_body(reference)
    assert got_meta == want_meta == {"kind": "full", "version": "3", "finished": "false"}
    assert got.keys() == want.keys() == tensors.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    assert safetensors.torch.load(bytes(built)).keys() == tensors.keys()


def test_pull_body_refuses_a_dtype_it_cannot_name() -> None:
    with pytest.raises(ValueError, match=r"'c'.*complex64"):
        payloads.encode_body_buffer({"c": torch.zeros(2, dtype=torch.complex64)}, {})


def test_update_chain_body_matches_safetensors() -> None:
    g = torch.Generator().manual_seed(1)
    chain = [(v, encode_tensors({"w": torch.randn(300, generator=g)}, "int8")) for v in (4, 5)]
    meta = {"kind": "updates", "version": 5, "fromVersion": 3}
    built = payloads.encode_update_chain_buffer(chain, meta)
    reference = payloads.encode_update_chain(chain, meta)
    got, got_meta = payloads.decode_body(built)
    want, want_meta = payloads.decode_body(reference)
    assert got_meta == want_meta and got.keys() == want.keys()
    assert sorted(got) == ["4/w::q", "4/w::scale", "5/w::q", "5/w::scale"]
    for name, t in want.items():
        assert torch.equal(got[name], t)


def test_push_body_tensors_are_views_of_the_body_and_match_safetensors() -> None:
    g = torch.Generator().manual_seed(2)
    tensors = {
        **encode_tensors({"w": torch.randn(600, generator=g)}, "int8"),
        "e": torch.zeros(0),
        "h": torch.randn(3, 2, generator=g).half(),
    }
    raw = bytearray(payloads.encode_body(tensors, {"kind": "push"}))
    got = payloads.tensors_in_body(raw)
    want = safetensors.torch.load(bytes(raw))
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    # No copy: the tensors read the body's own memory.
    start = 8 + _header_length(bytes(raw))
    raw[start] ^= 0xFF
    assert not torch.equal(payloads.tensors_in_body(raw)["w::scale"], want["w::scale"])


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}, "no dtype"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "do not fit its shape"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}, "do not fit its shape"),
        ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "shape must be"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}, "gap or overlap"),
    ],
)
def test_push_body_with_bad_offsets_is_refused(entry: dict[str, object], message: str) -> None:
    import json

    header = json.dumps({"t": entry}).encode()
    header += b" " * (-len(header) % 8)
    raw = bytearray(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(ValueError, match=message):
        payloads.tensors_in_body(raw)
