"""SamplingParams <-> pb.SamplingParams, both ways, by field name.

The router builds the GenerateRequest with `sampling_to_proto`; stage 0 reads
it with `sampling_from_proto`. Both walk the field list's `wire` fields
(sampling_fields.py), so a field added there, to SamplingParams and to
generation.proto under the same name travels without an edit here; `stop`
(the router's) is not sent.

Contract:
* every field of pb.SamplingParams is a wire field of the list and the
  other way round; checked when this module is imported, so a half-added
  field fails at start-up, not on the first request;
* a proto3 `optional` field is unset exactly when the Python value is None
  or the field's default (HasField); an unset one reads as the list's
  default (`repetition_penalty` 1, not proto3's 0); a `repeated` field is a
  list, a `map` a dict, anything else a scalar;
* `max_tokens` must be resolved (an int) before it goes on the wire: None
  ("up to the context") is resolved by the router against the prompt.
`sampling_from_proto` validates (SamplingParams' own checks): a bad message
from any client is an InvalidRequestError naming the field.
"""

from __future__ import annotations

from typing import Any

from pipeserve.rpc import generation_pb2 as pb
from pipeserve.sampling_fields import SAMPLING_FIELDS
from pipeserve.sampling_params import SamplingParams

_PROTO = pb.SamplingParams.DESCRIPTOR.fields_by_name
WIRE_FIELDS = tuple(f.name for f in SAMPLING_FIELDS if f.wire)
_DEFAULTS = {f.name: f.default for f in SAMPLING_FIELDS if f.wire}  # read for unset optional scalars


def _check_schema() -> None:
    missing = set(WIRE_FIELDS) - set(_PROTO)
    extra = set(_PROTO) - set(WIRE_FIELDS)
    if missing or extra:
        raise TypeError(
            "SamplingParams and generation.proto disagree: "
            f"not in the proto {sorted(missing)}, not in SamplingParams {sorted(extra)}"
        )


_check_schema()


def _repeated(name: str) -> bool:
    return _PROTO[name].is_repeated


def _map(name: str) -> bool:
    desc = _PROTO[name].message_type
    return desc is not None and desc.GetOptions().map_entry


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    if params.max_tokens is None:
        raise ValueError("max_tokens must be resolved against the prompt before it is sent")
    msg = pb.SamplingParams()
    for name in WIRE_FIELDS:
        value = getattr(params, name)
        if value is None:
            continue  # an optional field left unset
        if _map(name):
            getattr(msg, name).update(value)
        elif _repeated(name):
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    return msg


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    values: dict[str, Any] = {}
    for name in WIRE_FIELDS:
        if _PROTO[name].has_presence and not _repeated(name) and not msg.HasField(name):
            values[name] = _DEFAULTS[name]  # unset: the default (None for seed/logprobs, 1 for repetition)
        elif _map(name):
            values[name] = dict(getattr(msg, name))
        elif _repeated(name):
            values[name] = list(getattr(msg, name))
        else:
            values[name] = getattr(msg, name)
    return SamplingParams(**values)
