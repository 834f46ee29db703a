"""The fleet rules beside `decide` (pipeserve.care.restarts): which group may roll now, how many surge
groups a rollout may add, and when a surge group is wanted."""

from __future__ import annotations

import pytest

from pipeserve.care.restarts import FleetGroup, GroupPhase, max_surge, may_roll, want_surge

READY, STARTING, RESTARTING = GroupPhase.READY, GroupPhase.STARTING, GroupPhase.RESTARTING


def test_max_surge_defaults_to_one_for_a_single_group() -> None:
    assert max_surge(1, None) == 1
    assert max_surge(2, None) == 0 and max_surge(5, None) == 0
    assert max_surge(1, 0) == 0 and max_surge(3, 1) == 1
    with pytest.raises(ValueError, match="maxSurge"):
        max_surge(1, 2)


def test_a_group_rolls_only_while_every_other_group_is_ready() -> None:
    fleet = [FleetGroup(0, READY, outdated=True), FleetGroup(1, READY, outdated=True)]
    assert may_roll(0, fleet) and may_roll(1, fleet)
    rolling = [FleetGroup(0, RESTARTING), FleetGroup(1, READY, outdated=True)]
    assert not may_roll(1, rolling)  # one group down at a time
    surging = [FleetGroup(0, READY, outdated=True), FleetGroup(1, STARTING, surge=True)]
    assert not may_roll(0, surging)  # the surge group must be Ready first
    assert may_roll(0, [FleetGroup(0, READY, outdated=True), FleetGroup(1, READY, surge=True)])
    assert may_roll(0, [FleetGroup(0, READY, outdated=True)])  # maxSurge 0, one group: the user's choice


def test_a_surge_group_is_wanted_for_the_whole_rollout_only() -> None:
    old = [FleetGroup(0, READY, outdated=True)]
    assert want_surge(1, 1, old)
    assert not want_surge(1, 0, old)  # maxSurge 0
    assert not want_surge(1, 1, [FleetGroup(0, READY)])  # nothing to roll
    # The old group went down for its roll: the surge group stays until it is Ready again.
    mid = [FleetGroup(0, RESTARTING), FleetGroup(1, READY, surge=True)]
    assert want_surge(1, 1, mid)
    assert want_surge(1, 1, [FleetGroup(0, STARTING), FleetGroup(1, READY, surge=True)])
    assert not want_surge(1, 1, [FleetGroup(0, READY), FleetGroup(1, READY, surge=True)])  # done
    # A group left over by a scale-down is no surge group: a restarting group does not keep it.
    assert not want_surge(1, 1, [FleetGroup(0, STARTING), FleetGroup(1, READY)])
