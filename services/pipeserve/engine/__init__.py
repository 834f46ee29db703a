"""The deciding side, on stage 0 only (DESIGN: only stage 0 decides): the engine loop (engine.py),
the scheduler and its block manager, requests, the L2/L3 decisions (host_index.py,
prefix_loads.py), grammar checks before admission (grammar.py) and prompt-logprob bookkeeping.
plan.py is the only contract with the executing side (worker/); executor.py is the protocol by
which plans get executed, handed in from outside: nothing here imports worker/.
"""
