"""`pipeserve bench`: an online serving benchmark in the manner of SGLang's `bench_serving`.

It drives any OpenAI-compatible server over HTTP (`/v1/completions`, streamed) and reports
request/token throughput and TTFT, ITL and end-to-end latency percentiles
(`serving.py`, `client.py`, `metrics.py`, `workloads.py`); `--router-overhead` measures
the latency the router adds over calling stage 0's gRPC `Generate` directly
(`overhead.py`); `--compare PEER_URL` is the side-by-side against another server (`compare.py`):
a sweep of cells (`cells.py`) run round after round, servers alternating (`sweep.py`, servers in
`launch.py`), fresh prompts in every pass (`prompts.py`) checked for cache hits by the servers'
own counters (`cachecheck.py`), process-tree RSS sampled (`host.py`), medians, spreads and ratios
(`sweep_report.py`, `sweep_plot.py`). `benchmarks/peer.py` builds llama.cpp's server and runs
it, starting each server per round with the flags of `peers.py`.
"""
