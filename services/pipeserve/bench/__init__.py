"""`pipeserve bench`: an online serving benchmark in the manner of SGLang's `bench_serving`.

It drives any OpenAI-compatible server over HTTP (`/v1/completions`, streamed) and reports
request/token throughput and TTFT, ITL and end-to-end latency percentiles
(`serving.py`, `client.py`, `metrics.py`, `workloads.py`); `--router-overhead` measures
the latency the router adds over calling stage 0's gRPC `Generate` directly
(`overhead.py`); `--compare PEER_URL` runs one workload against pipeserve and another server
and reports both and their ratios (`compare.py`; `benchmarks/peer.py` builds llama.cpp's server for it).
"""
