"""The ring channel: frames that stage k sends to stage (k+1) % S.

Every frame travels as a fixed int64 header [payload_bytes, rows, cols, 0],
then the msgpack payload (one of the Frame structs below, tagged), then,
when rows > 0, an activation tensor [rows, cols] in the group's dtype. Nothing
is pickled; a frame that does not decode into these types is a link failure.

Who sends what:
  Hello      stage 0 -> ... -> stage 0 once at start-up: forms and warms every link
  Heartbeat  stage 0 -> ... -> stage 0 whenever the ring has been idle heartbeat_s
  Forward    stage k -> k+1 (k < S-1): the plan, the reports so far, activations
  Result     stage S-1 -> stage 0: sampled tokens and every stage's report
  Stop       any stage, forwarded round the ring once: clean shutdown or group stop
"""

from __future__ import annotations

import msgspec

from pipeserve.engine.plan import StageReport, StepOutput, StepPlan


class Hello(msgspec.Struct, tag="hello", frozen=True):
    visited: list[int]  # ranks the frame has passed through


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    seq: int


class Forward(msgspec.Struct, tag="forward", frozen=True):
    plan: StepPlan
    reports: list[StageReport]


class Result(msgspec.Struct, tag="result", frozen=True):
    output: StepOutput


class Stop(msgspec.Struct, tag="stop", frozen=True):
    origin: int  # rank that decided to stop
    reason: str  # one line naming the cause
    error: bool  # False: clean shutdown; True: group stop (every stage exits non-zero)


Frame = Hello | Heartbeat | Forward | Result | Stop

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


def encode_frame(frame: Frame) -> bytes:
    return _encoder.encode(frame)


def decode_frame(data: bytes) -> Frame:
    return _decoder.decode(data)
