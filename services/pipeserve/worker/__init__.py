"""The executing side: what every stage runs on tensors, deciding nothing (DESIGN: only stage 0
decides). A stage's ModelRunner (model_runner.py, built by build.py) applies each StepPlan
(engine/plan.py, the only contract) to its tables and KV pool (kv_cache.py), runs its layers and,
on the last stage, samples (sampler.py, penalties.py, grammar.py's matchers) and scores prompt
tokens (prompt_logprobs.py). local.py is the one-stage group's Executor (engine/executor.py).
"""
