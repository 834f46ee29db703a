"""Pipeline-group stages: the ring transport, the follower loop, stage 0's side of the ring."""
