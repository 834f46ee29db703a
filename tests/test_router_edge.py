"""The HTTP edge against hostile input: stop strings, bodies, headers, auth, batches, shutdown.

Each test pins one rule of the router's edge (issue 9 §2) against a real router (uvicorn, real HTTP)
over real gRPC (scripted stages, tests/router_support.py) or live stage processes where a group's
own behaviour matters; the load tests (does one client slow the others?) are in test_hostile_load.py.
"""

from __future__ import annotations

import random

import pytest

from pipeserve.detokenize import MAX_STOP_CHARS, MAX_STOP_STRINGS, TextStream, held_suffix
from pipeserve.errors import InvalidRequestError
from pipeserve.sampling_params import SamplingParams


def chars(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def test_stop_matcher_agrees_with_the_plain_definition() -> None:
    """Every release and every cut equals what the reference held_suffix / find would give."""
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(1, 5)
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(n)]
        text = [ord(rng.choice("abcd")) for _ in range(rng.randint(0, 40))]
        ts = TextStream(chars, stops)
        out = ""
        for k, t in enumerate(text):
            out += ts.push(t)
            if ts.stopped:
                break
            assert len(out) == k + 1 - held_suffix(chars(text[: k + 1]), stops), (stops, text[: k + 1])
        out += ts.finish()
        full = chars(text)
        # The token (here: character) that first completes a stop string ends the stream; the text is
        # cut where the earliest-starting stop string ending in that token starts.
        ends = (e for e in range(1, len(full) + 1) if any(full[:e].endswith(s) for s in stops))
        end = next(ends, None)
        hits = [end - len(s) for s in stops if end is not None and full[:end].endswith(s)]
        assert out == (full[: min(hits)] if hits else full), (stops, full)
        assert ts.stopped == bool(hits)


def test_stop_matching_work_is_linear_in_the_text() -> None:
    """The largest accepted stop configuration: transitions per character stay bounded (no rescans)."""
    rng = random.Random(0)
    each = MAX_STOP_CHARS // MAX_STOP_STRINGS
    stops = ["".join(rng.choice("ab") for _ in range(each - 1)) + "z" for _ in range(MAX_STOP_STRINGS)]
    SamplingParams(stop=stops)  # accepted
    text = [ord(rng.choice("ab")) for _ in range(4000)]  # prefixes of the stops match all along
    ts = TextStream(chars, stops)
    out = "".join(ts.push(t) for t in text) + ts.finish()
    assert out == chars(text)
    # Aho-Corasick: one transition per character plus failure steps, never more than the characters.
    assert ts.steps <= 2 * len(text), ts.steps


@pytest.mark.parametrize(
    "stops",
    [["x"] * (MAX_STOP_STRINGS + 1), ["y" * (MAX_STOP_CHARS // 2 + 1)] * 2],
    ids=["too-many", "too-long"],
)
def test_stop_strings_beyond_the_caps_are_refused(stops: list[str]) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop=stops)
    assert e.value.param == "stop"
