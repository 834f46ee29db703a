"""A group becomes routable soon after its Health turns ready, not a whole poll interval later: the
router polls a group that is not routable fast (start-up time of `pipeserve up`)."""

from __future__ import annotations

import time
from pathlib import Path

from router_support import RouterHarness, ScriptedStage
from serving_support import wait_until

SLOW_INTERVAL_S = 10.0  # the routable groups' poll period here: far above the bound below
BOUND_S = 1.0


def test_group_routable_within_bound_after_health_turns_ready(llama_dir: Path):
    stage = ScriptedStage([5, 6])
    stage.ready = False
    with RouterHarness(llama_dir, {"g0": stage}, wait_ready=0, health_interval_s=SLOW_INTERVAL_S) as h:
        # The router has seen it unready (a poll answered), so a slow poller would next ask ~10 s later.
        wait_until(lambda: h.call(lambda: h.replicas.snapshot()[0]["status"] != "unknown"), 10, "first poll")
        assert not h.call(h.replicas.ready_groups)
        stage.ready = True
        t0 = time.monotonic()
        wait_until(lambda: h.call(h.replicas.ready_groups), 5 * BOUND_S, "g0 routable")
        assert time.monotonic() - t0 < BOUND_S
