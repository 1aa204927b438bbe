"""How a job's pods are placed: the user's pod template fragments, merged into ours (pure).

What each island gets (its override entry, replicas and resources) is the spec's to say
(api/placement.IslandPlacement, read as `spec.islands.replicas_of(i)`); this module builds it into
pod templates.

Every pod takes the job's own labels and annotations first (but not the bookkeeping ones: see
naming.UNPASSED_ANNOTATION_PREFIXES); learner pods then take `islands.template`, then their
island's entry of `islands.overrides` (nodeSelector, then template); the syncer pod takes
`syncer.template`. Merging follows
`pods.merge_overrides`; the labels the selectors match on are put back afterwards, since they are
not the user's to change.
"""

from __future__ import annotations

import copy
from typing import Any

from diloco_trainer.api import contract

from diloco_operator.api import DiLoCoJobSpec
from diloco_operator.resources.naming import JobRef
from diloco_operator.resources.pods import merge_overrides


def island_replicas_by_name(spec: DiLoCoJobSpec) -> dict[str, int]:
    """{island name: pods it should have} for every desired island."""
    return {
        contract.island_name(spec.islands.name_prefix, i): spec.islands.replicas_of(i)
        for i in range(spec.islands.count)
    }


def island_resources(spec: DiLoCoJobSpec, index: int) -> dict[str, Any]:
    """Resource requirements of island `index`'s learner container (its override's, if any)."""
    return copy.deepcopy(spec.islands.resources_of(index))


def job_fragment(job: JobRef) -> dict[str, Any]:
    """The job's own labels and annotations, as a pod template fragment (merged first: the
    templates of the spec win over them)."""
    metadata: dict[str, Any] = {}
    if job.pod_labels:
        metadata["labels"] = dict(job.pod_labels)
    if job.pod_annotations:
        metadata["annotations"] = dict(job.pod_annotations)
    return {"metadata": metadata} if metadata else {}


def island_template_fragments(job: JobRef, spec: DiLoCoJobSpec, index: int) -> list[dict[str, Any]]:
    """The user's fragments for island `index`'s pod template, in the order they merge."""
    fragments = [job_fragment(job), spec.islands.template]
    entry = spec.islands.override_of(index)
    if entry is not None:
        if entry.node_selector:
            fragments.append({"spec": {"nodeSelector": dict(entry.node_selector)}})
        fragments.append(entry.template)
    return [f for f in fragments if f]


def with_user_fragments(
    template: dict[str, Any], fragments: list[dict[str, Any]], selector_labels: dict[str, str]
) -> dict[str, Any]:
    """`template` with each fragment merged in, then the selector labels restored."""
    for fragment in fragments:
        template = merge_overrides(template, fragment)
    metadata = template.setdefault("metadata", {})
    metadata.setdefault("labels", {}).update(selector_labels)
    return template
