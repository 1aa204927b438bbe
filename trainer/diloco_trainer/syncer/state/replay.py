"""Answers to recent pushes by pushId: a retried or replayed push gets its first answer again
instead of being counted twice.

The syncer keeps the last `window` pushIds of each island and fragment (not only the latest): an
older push sent again (a client retry that lost its answer, or a replay) is answered as a
duplicate. With a window of maxStaleness + 1 (push_window) anything older is refused anyway: an
island pushes a fragment again only after the merge of its previous push, so its k-th previous
push is based on a version at least k versions old.

Checkpoints keep the answers of pushes already merged (merged: api/manifest.SavedAnswer), the
`saved` most recent, so this holds across a restart too; a pending push is left out (rounds are
not checkpointed, so its retry after a restart must be accepted afresh).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from diloco_trainer.api.documents import PushAnswer
from diloco_trainer.api.manifest import SavedAnswer

# Push ids remembered per island and fragment, at least (see push_window).
REPLAY_WINDOW = 64
# Answers saved in checkpoints (the most recent merged ones).
SAVED_ANSWERS = 4096


def push_window(max_staleness: int) -> int:
    """Push ids to remember per island and fragment: enough that an older replay is stale."""
    return min(4096, max(REPLAY_WINDOW, max_staleness + 1))


class PushAnswers:
    """(island, fragment) -> the answers of its last `window` pushes, by pushId."""

    def __init__(self, window: int = REPLAY_WINDOW, saved: int = SAVED_ANSWERS) -> None:
        self.window = window
        self.saved = saved
        self._answers: dict[tuple[str, int], OrderedDict[str, tuple[int, PushAnswer]]] = {}
        self._seq = itertools.count()

    def get(self, island: str, fragment: int, push_id: str) -> PushAnswer | None:
        """The answer given to an earlier push with this id, if it is remembered."""
        if not push_id:
            return None
        ids = self._answers.get((island, fragment))
        entry = ids.get(push_id) if ids is not None else None
        return entry[1] if entry is not None else None

    def put(self, island: str, fragment: int, push_id: str, answer: PushAnswer) -> None:
        """Remember the answer to a push (the oldest of the key beyond `window` is forgotten)."""
        if not push_id:
            return
        ids = self._answers.setdefault((island, fragment), OrderedDict())
        ids.pop(push_id, None)
        ids[push_id] = (next(self._seq), answer)
        while len(ids) > self.window:
            ids.popitem(last=False)

    def forget(self, island: str) -> None:
        """Drop every answer of an island (its record was replaced)."""
        for key in [k for k in self._answers if k[0] == island]:
            del self._answers[key]

    def merged(self, versions: list[int]) -> list[SavedAnswer]:
        """Answers to pushes already merged (answered version < the fragment's version), the
        `saved` most recent, oldest first, for checkpoints."""
        entries = [
            (seq, SavedAnswer(island=island, fragment=f, push_id=push_id, answer=answer))
            for (island, f), ids in self._answers.items()
            if 0 <= f < len(versions)
            for push_id, (seq, answer) in ids.items()
            if answer.version < versions[f]
        ]
        entries.sort(key=lambda e: e[0])
        return [doc for _, doc in entries[-self.saved :]]

    def restore(self, doc: list[SavedAnswer], fragments: int) -> None:
        """Load merged() (older checkpoints kept one answer per island and fragment: the same
        form)."""
        for entry in doc[-self.saved :]:
            if 0 <= entry.fragment < fragments:
                self.put(entry.island, entry.fragment, entry.push_id, entry.answer)
