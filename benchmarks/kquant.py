"""GGUF K-quants served from their blocks (issue 28 point 3): decode speed, memory, agreement, and a
cross-check against llama.cpp's own quantizer.

    python benchmarks/kquant.py                      # decode tok/s of each file vs the Q4_1 path
    python benchmarks/kquant.py --mixes Q4_1 Q4_K_M --rounds 5
    python benchmarks/kquant.py --agreement          # + teacher-forced agreement of each file
    python benchmarks/kquant.py --peer               # + files made by llama-quantize (built if absent)

The checkpoint is the llama.cpp peer's 169M model (benchmarks/peer.py `model`: hidden 1024,
intermediate 2816, 12 layers, 16/4 heads: every row a multiple of 256, as K-quants need). The
project's writer (tests/gguf_support.py, the reference quantizer model/gguf_quant.py) writes it as
one GGUF per mix (Q4_1 by gguf-py, the baseline path; Q4_K_M = attn_v, ffn_down and output in Q6_K,
the rest Q4_K; and one type throughout); pipeserve converts each and serves it with
`--quantization gguf`. Per file: its size, the weight bytes the stage holds (and their ratio to the
file: the issue's bar is 1.3x), and single-stream greedy decode tok/s = new tokens / (time of a
129-token request - time of a 1-token one), the median of `--rounds` rounds that alternate the
files; the ratio to Q4_1 (the goal: >= 0.9x). Run it on a quiet machine (load is printed before
and after: a busy one is no measurement, DESIGN §10.15).

`--peer`: llama-quantize (built in .peer/build, target llama-quantize, as peer.py builds
llama-server) quantizes llama.cpp's own F32 GGUF of the same checkpoint (.peer/model-169m-f32.gguf)
to Q4_K_M, Q6_K and Q5_K_M. For each tensor both files share in a type: the share of identical
block bytes and the RMS of the two dequantizations' difference relative to the weight's (our
quantizer sums in another order: ties may fall differently, DESIGN of gguf_quant.py); and the peer's
files are served too (a file made by llama.cpp itself, with its own type choices per layer).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the project's GGUF writer (gguf_support)
PEER = ROOT / ".peer"
MODEL = PEER / "model-169m"
PEER_F32 = PEER / "model-169m-f32.gguf"
OUT = PEER / "kquant"
QUANTIZE = PEER / "build" / "bin" / "llama-quantize"
PEER_TYPES = ("Q4_K_M", "Q6_K", "Q5_K_M")


def _mix(name: str):
    from gguf import GGMLQuantizationType as Q

    from gguf_support import q4_k_m

    if name == "Q4_K_M":
        return q4_k_m
    return lambda hf: None if hf.endswith("norm.weight") else Q[name]


def cpu() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    simd = [f for f in flags if f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")]
    return f"{model or platform.processor()} ({os.cpu_count()} CPUs; {' '.join(simd)})"


def ensure_files(mixes: list[str]) -> dict[str, tuple[Path, Path]]:
    """mix -> (GGUF file, converted directory), made if absent."""
    from gguf_support import write_llama_gguf
    from pipeserve.model.default import CONVERTER_VERSION
    from pipeserve.model.gguf import convert_gguf

    if not MODEL.is_dir():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peer.py"), "model"], check=True)
    OUT.mkdir(parents=True, exist_ok=True)
    out = {}
    for mix in mixes:
        # the converter's version names the directory: a served form that changed is converted again
        src, conv = OUT / f"{mix}.gguf", OUT / f"{mix}-out-c{CONVERTER_VERSION}"
        if not src.exists():
            write_llama_gguf(MODEL, src, quant=_mix(mix))
        if not conv.exists():
            convert_gguf(src, conv)
        out[mix] = (src, conv)
    return out


def peer_files() -> dict[str, tuple[Path, Path | None]]:
    """llama-quantize's files of the same checkpoint (built and made if absent), converted; a file
    pipeserve refuses to convert (its error printed) is still cross-checked, not served (None)."""
    from pipeserve.errors import ModelLoadError
    from pipeserve.model.default import CONVERTER_VERSION
    from pipeserve.model.gguf import convert_gguf

    if not QUANTIZE.exists():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peer.py"), "build"], check=True)
        subprocess.run(["cmake", "--build", str(PEER / "build"), "--target", "llama-quantize"], check=True)
    if not PEER_F32.exists():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peer.py"), "convert"], check=True)
    out = {}
    for t in PEER_TYPES:
        src, conv = OUT / f"peer-{t}.gguf", OUT / f"peer-{t}-out-c{CONVERTER_VERSION}"
        if not src.exists():
            subprocess.run([str(QUANTIZE), str(PEER_F32), str(src), t], check=True, capture_output=True)
        try:
            if not conv.exists():
                convert_gguf(src, conv)
        except ModelLoadError as exc:
            print(f"peer {t}: not served ({exc})", flush=True)
            out[f"peer {t}"] = (src, None)
            continue
        out[f"peer {t}"] = (src, conv)
    return out


def cross_check(ours: Path, peer: Path) -> list[str]:
    """Per tensor both files hold in the same type: identical block bytes and the dequantizations'
    relative RMS difference."""
    import gguf
    import numpy as np

    a = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    rows = []
    for t in gguf.GGUFReader(peer).tensors:
        mine = a.get(t.name)
        if mine is None or mine.tensor_type != t.tensor_type or t.tensor_type in (0, 1):
            continue
        same = float(np.mean(np.asarray(mine.data) == np.asarray(t.data)))
        x = gguf.quants.dequantize(t.data, t.tensor_type)
        y = gguf.quants.dequantize(mine.data, mine.tensor_type)
        rel = float(np.sqrt(((x - y) ** 2).mean() / max((x**2).mean(), 1e-30)))
        rows.append(
            f"| {t.name} | {gguf.GGMLQuantizationType(t.tensor_type).name} | {100 * same:.2f} % | {rel:.2e} |"
        )
    return rows


def decode_rate(llm, prompt: list[int], new: int) -> float:
    from pipeserve.sampling_params import SamplingParams

    def timed(n: int) -> float:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - start

    return new / (timed(new + 1) - timed(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mixes", nargs="+", default=["Q4_1", "Q4_K_M", "Q4_K", "Q5_K", "Q6_K", "Q8_0"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--agreement", action="store_true", help="teacher-forced agreement per file (slow)")
    p.add_argument("--peer", action="store_true", help="cross-check against llama-quantize's files")
    args = p.parse_args()
    from pipeserve import LLM
    from pipeserve.model.gguf_blocks import GgufBlocks

    print(f"CPU: {cpu()}; load before: {os.getloadavg()}", flush=True)
    files: dict[str, tuple[Path, Path]] = ensure_files(args.mixes)
    peers = peer_files() if args.peer else {}
    files.update({k: (src, conv) for k, (src, conv) in peers.items() if conv is not None})
    prompt = list(range(100, 132))
    rates: dict[str, list[float]] = {k: [] for k in files}
    weights: dict[str, int] = {}
    for r in range(args.rounds):
        order = list(files) if r % 2 == 0 else list(reversed(files))
        for name in order:
            with LLM(str(files[name][1]), quantization="gguf", kv_cache_gb=0.25) as llm:
                weights[name] = llm.engine.executor.runner.model.weight_bytes()
                decode_rate(llm, prompt, 8)  # warm-up
                rates[name].append(decode_rate(llm, prompt, args.new_tokens))
    base = statistics.median(rates["Q4_1"]) if "Q4_1" in rates else None
    print(f"load after: {os.getloadavg()}")
    print("| file | types | file MB | weights MB | ÷ file | decode tok/s, median [min–max] | ÷ Q4_1 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, (src, conv) in files.items():
        with GgufBlocks(conv) as blocks:
            kinds = sorted(set(blocks.types.values()) - {"F32"})
        med = statistics.median(rates[name])
        ratio = f"{med / base:.2f}×" if base else "n/a"
        size, lo, hi = src.stat().st_size, min(rates[name]), max(rates[name])
        print(
            f"| {name} | {' '.join(kinds)} | {size / 1e6:.1f} | {weights[name] / 1e6:.1f} | "
            f"{weights[name] / size:.2f} | {med:.1f} [{lo:.1f}–{hi:.1f}] | {ratio} |"
        )
    if args.agreement:
        from pipeserve.bench.agreement import PROMPTS, agreement

        print("\n| file | teacher-forced agreement | free-running shared prefix |\n|---|---:|---:|")
        for name, (_, conv) in files.items():
            a = agreement(str(conv), "gguf", PROMPTS, 64, kv_cache_gb=0.25)
            print(f"| {name} | {a.agreed}/{a.tokens} = {100 * a.rate:.1f} % | {a.exact_prefix}/{a.tokens} |")
    if args.peer and "Q4_K_M" in files:
        print("\n| tensor | type | identical bytes | rel. RMS of the difference |\n|---|---|---:|---:|")
        print("\n".join(cross_check(files["Q4_K_M"][0], peers["peer Q4_K_M"][0])))
    if shutil.which("git"):
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        )
        print(f"\n<!-- pipeserve {rev.stdout.strip()} -->")
    return 0


if __name__ == "__main__":
    sys.exit(main())
