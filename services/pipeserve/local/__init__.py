"""One machine's processes: the launcher of a group's stages 1..S-1 (launcher) and a private
redis-server on loopback (redis_server), used by the offline `LLM`, `pipeserve up` and the tests.
The operator (pipeserve_operator) never imports this package (tests/test_import_graph.py)."""
