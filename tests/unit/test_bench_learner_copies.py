"""bench.studies.learner_copies counts each byte of the live tensors once: a view made by
torch.frombuffer inside a decoded body's buffer (a learner's Δ base from a pulled body) has a
storage of its own, which lies inside the buffer's."""

from __future__ import annotations

from bench.studies.learner_copies import attributed


def test_a_named_storage_inside_a_buffer_is_counted_once_under_its_name() -> None:
    # A body [100, 200): a base tensor's view [108, 150), an unnamed view [150, 200); apart
    # from it the weights [500, 510) and a runtime buffer [600, 607).
    storages = {100: 100, 108: 42, 150: 50, 500: 10, 600: 7}
    got = attributed(storages, {108: "base", 500: "weights"})
    assert got == {"base": 42, "weights": 10, "link or runtime": (100 - 42) + 7}
    assert sum(got.values()) == 100 + 10 + 7  # the bytes there are, not 209
