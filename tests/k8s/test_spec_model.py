"""The typed InferencePipeline spec (spec.py) is the CRD's schema, and the operator parses a CR into it.

The schema's defaults are the model's defaults (one definition: a field the API server defaults reads
back the same typed), parsing the API server's defaulted spec gives typed values, and a spec the schema
refuses is refused by the parse too (a CR stored before a bound existed).
"""

from __future__ import annotations

import msgspec
import pytest

from pipeserve_operator.crd import spec_schema, with_defaults
from pipeserve_operator.spec import PipelineSpec, parse

MINIMAL = {"model": {"path": "/m"}, "image": "img:1"}


def test_schema_defaults_are_the_models() -> None:
    typed = parse(MINIMAL)
    for name, sub in spec_schema()["properties"].items():
        if "default" in sub:
            assert msgspec.to_builtins(getattr(typed, name)) == sub["default"], name
    assert list(spec_schema()["properties"]) == list(PipelineSpec.__struct_fields__)


def test_the_defaulted_spec_parses_typed() -> None:
    spec = with_defaults({**MINIMAL, "stages": 2, "rollout": {"partition": 1}, "restartBackoffSeconds": 1})
    typed = parse(spec)
    assert (typed.stages, typed.replicas, typed.router.policy) == (2, 1, "round_robin")
    assert typed.rollout is not None and typed.rollout.partition == 1 and typed.rollout.maxSurge is None
    assert typed.restartBackoffSeconds == 1.0 and typed.placement.gang == "none"


@pytest.mark.parametrize(
    "bad", [{"stages": 0}, {"stages": 65}, {"rollout": {"partition": -1}}, {"stages": "2"}, {"image": ""}]
)
def test_a_spec_the_schema_refuses_does_not_parse(bad: dict) -> None:
    with pytest.raises(msgspec.ValidationError):
        parse({**MINIMAL, **bad})
