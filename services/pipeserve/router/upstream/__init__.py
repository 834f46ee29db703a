"""The groups behind the router: the fan-out of a request into Generate calls (fanout), a group
picked (policy, replicas, discovery*) and streamed from (upstream, serving), and their metrics and
spans. Imports router.errors, features/ and api/, never http/."""
