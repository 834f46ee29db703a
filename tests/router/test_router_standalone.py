"""`pipeserve router` on its own, in front of a live 2-stage group: it needs only the tokenizer files
(a directory without weights or config), serves greedy ids equal to transformers', follows the group
out of and back into routing, refuses a bad --upstream at start-up, and exits 0 on SIGTERM."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from conftest import hf_greedy
from pipeserve.local.ports import free_port
from serving_support import live_group, wait_http, wait_until


def _router(tokenizer: Path, upstream: str, port: int, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pipeserve.cli", "router", "--tokenizer", str(tokenizer)]
    argv += ["--upstream", upstream, "--port", str(port), "--health-interval-s", "0.2"]
    return subprocess.Popen(argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def test_standalone_router_over_a_live_group(llama_dir: Path, tmp_path: Path) -> None:
    tok = tmp_path / "tokenizer-only"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / name, tok / name)
    prompt = [5, 17, 300, 42, 7, 99, 123, 8]
    want = hf_greedy(llama_dir, prompt, 8)
    with live_group(llama_dir, 2, tmp_path / "logs") as slot:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = _router(tok, slot.grpc_target, port, tmp_path / "router.log")
        try:
            wait_http(url + "/health", 60, alive=lambda: proc.poll())
            body = {"model": str(tok), "prompt": prompt, "max_tokens": 8, "temperature": 0}
            r = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want
            # The group goes away: out of routing (503, not a hang); a request waits on nothing.
            slot.kill(grace_s=5.0)
            wait_http(url + "/health", 30, status=503, alive=lambda: proc.poll())
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 503, r.text
            # Back on the same port: routed again without restarting the router.
            slot.start()
            wait_http(url + "/health", 120, alive=lambda: proc.poll())
            r = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text
        finally:
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: proc.poll() is not None, 30, "the router exiting")
        assert proc.returncode == 0, (tmp_path / "router.log").read_text()[-2000:]


def test_a_bad_upstream_is_refused_at_start(llama_dir: Path) -> None:
    for bad in ("", "localhost", "h:99999", "h:x"):
        r = subprocess.run(
            [sys.executable, "-m", "pipeserve.cli", "router", "--model", str(llama_dir), "--upstream", bad],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and "upstream" in r.stderr, (bad, r.stderr)
