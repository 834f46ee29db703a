"""A stage process: its entry point (main) and stage 0's front — the gRPC request server
(server), the engine loop that owns the engine (engine_loop), and the engine's construction
with its executor (factory). The ring is in `pipeserve.ring`, process care in `pipeserve.care`."""
