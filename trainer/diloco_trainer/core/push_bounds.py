"""How many inner steps one push may carry: the one rule the syncer refuses a push by
(syncer/guards.WorkBounds, 422 steps_out_of_range) and the learner holds its steps to
(learner/fragment_sync.FragmentSync: it stops stepping at the bound and waits for the syncer
rather than make work that would be refused). The learner and the syncer never import each
other, so the rule lives here, where both can.
"""

from __future__ import annotations

from diloco_trainer.api.spec import JobSpec

# A push may hold this many rounds of an island's steps (plus the overlap): a learner pushes each
# fragment once per H steps, a little later after phase alignment or a slow merge.
STEP_ROUNDS = 4


def max_push_steps(spec: JobSpec) -> int:
    """The most inner steps one push may carry: STEP_ROUNDS x H + τ (sync.overlapSteps)."""
    return STEP_ROUNDS * spec.inner.steps + (spec.sync.overlap_steps or 0)
