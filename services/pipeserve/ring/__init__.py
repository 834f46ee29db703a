"""The ring: how the stages of one pipeline group form, talk and stop together.

Group forming and congruence (group), the frames (messages), the links with
their ordering rules and deadlines (transport), one stage's slice of the model
and pool (worker), stage 0's executor over the ring (leader), the loop of a
stage k > 0 (follower), and fault injection for tests (faults).
"""
