"""Canary rollouts: `spec.rollout.partition`, as a StatefulSet's partition, over whole groups.

    revs = Revisions.of(pipeline, full_spec, status)
    revs.view(i)      the pipeline as group i renders it (its StatefulSet, Service, PodGroup)
    revs.typed(i)     group i's spec, typed (spec.parse: once per revision; msgspec.ValidationError)
    revs.digest(i)    the spec hash group i's pods must carry (observe.py: else outdated, rolled)
    revs.stored(all_updated) -> status.currentSpec to write

Two revisions, as a StatefulSet keeps them: the *update* spec (the resource's spec now) and the
*current* spec (the last one every group ran). Groups with index >= partition take the update spec;
groups below it keep rendering, and running, the current one (a group below the partition that was
deleted, or restarts, comes back on the current spec; one that ran the update spec rolls back). Scaling
up adds groups at the top, >= partition: they take the update spec. The router serves every Ready
group, whichever revision it runs.

The current spec is kept in `status.currentSpec` as JSON text (a merge patch of the status replaces a
string whole; an object there would keep every key the new spec dropped), less the fields that never
change what a group runs (objects.NOT_ROLLED: replicas, rollout, router, backoffs: those always come
from the resource). It becomes the update spec once every group 0..replicas-1 runs the update spec
(partition 0 and the rollout done, or an update equal to it), as a StatefulSet's currentRevision does.
A status without it (a new pipeline, an operator upgraded from before canaries) starts from the update
spec. status.currentRevision / updateRevision are the two hashes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from pipeserve_operator import spec as spec_model
from pipeserve_operator.objects import NOT_ROLLED, spec_hash
from pipeserve_operator.spec import PipelineSpec

STATUS_FIELD = "currentSpec"


def _rolled(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k not in NOT_ROLLED}


@dataclasses.dataclass(frozen=True)
class Revisions:
    pipeline: dict[str, Any]
    update: dict[str, Any]  # the resource's spec, defaulted
    current: dict[str, Any]  # what groups below the partition run: stored rolled fields + update's others
    partition: int

    @classmethod
    def of(cls, pipeline: dict[str, Any], full: dict[str, Any], status: dict[str, Any]) -> Revisions:
        current = full
        text = (status or {}).get(STATUS_FIELD)
        if isinstance(text, str) and text:
            try:
                stored = json.loads(text)
            except ValueError:
                stored = None
            if isinstance(stored, dict):
                current = {**_rolled(stored), **{k: full[k] for k in NOT_ROLLED if k in full}}
        return cls(pipeline, full, current, spec_model.shape(full).partition)

    def spec(self, index: int) -> dict[str, Any]:
        return self.update if index >= self.partition else self.current

    @functools.cached_property
    def _typed_update(self) -> PipelineSpec:
        return spec_model.parse(self.update)

    @functools.cached_property
    def _typed_current(self) -> PipelineSpec:
        return spec_model.parse(self.current)

    def typed(self, index: int) -> PipelineSpec:
        """Group `index`'s spec, typed: each revision parsed once (the first call raises
        msgspec.ValidationError for a spec the model refuses, as every later one does)."""
        return self._typed_update if self.spec(index) is self.update else self._typed_current

    def view(self, index: int) -> dict[str, Any]:
        return {**self.pipeline, "spec": self.spec(index)}

    def digest(self, index: int) -> str:
        return spec_hash(self.spec(index))

    def stages(self, index: int) -> int:
        return spec_model.shape(self.spec(index)).stages

    @property
    def update_revision(self) -> str:
        return spec_hash(self.update)

    @property
    def current_revision(self) -> str:
        return spec_hash(self.current)

    def held_back(self) -> bool:
        """Some group is kept on the current spec by the partition (the two specs differ)."""
        return self.partition > 0 and self.current_revision != self.update_revision

    def stored(self, all_updated: bool) -> str:
        """status.currentSpec: the update spec once every group runs it, else the current one."""
        base = self.update if all_updated else self.current
        return json.dumps(_rolled(base), sort_keys=True, separators=(",", ":"))
