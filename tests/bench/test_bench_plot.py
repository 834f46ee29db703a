"""`pipeserve bench`'s progress bar and `--plot`, against the stand-in streaming server of
test_bench.py (known sleeps, a free 127.0.0.1 port, under uvicorn in a thread)."""

from __future__ import annotations

import asyncio
import json
import struct
import sys

import pytest
from PIL import Image
from test_bench import Served, bench_cli, fixed, openai_app

from pipeserve.bench import client, plot

pytestmark = pytest.mark.timeout(120)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_is_written_next_to_the_json(tmp_path, capsys):
    app, _ = openai_app(ttft=0.02, itl=0.005)
    out_json, out_png = tmp_path / "run.json", tmp_path / "run.png"
    with Served(app) as srv:
        argv = ["bench", "--url", srv.url, "--num-requests", "12", "--concurrency", "4"]
        argv += ["--input-len", "8", "--output-len", "6", "--warmup", "1"]
        argv += ["--json", str(out_json), "--plot", str(out_png)]
        assert bench_cli(argv) == 0
    assert json.loads(out_json.read_text())["results"]["completed"] == 12
    data = out_png.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1500, 450) and len(data) > 20_000  # three panels drawn, not a blank page
    with Image.open(out_png) as im:
        im.verify()
    assert f"plot written to {out_png}" in capsys.readouterr().err


def test_throughput_series_counts_every_output_token():
    app, _ = openai_app(ttft=0.01, itl=0.01)
    with Served(app) as srv:
        results, _ = asyncio.run(_run(srv.url, 5))
    x, y = plot.throughput_series(results)
    width = x[1] - x[0] if len(x) > 1 else 1.0
    assert sum(y) * width == pytest.approx(sum(r.output_len for r in results))
    assert all(r.start > 0 for r in results)


async def _run(url: str, n: int, progress: bool = False):
    async with client.make_client(url, 4, 30.0, None) as http:
        return await client.run_requests(http, "test-model", fixed(n), [0.0] * n, 4, 30.0, progress=progress)


def test_progress_bar_counts_completed_requests(capsys):
    app, _ = openai_app()
    with Served(app) as srv:
        asyncio.run(_run(srv.url, 6, progress=True))
        err = capsys.readouterr().err
        assert "requests" in err and "6/6" in err
        asyncio.run(_run(srv.url, 6, progress=False))
        assert capsys.readouterr().err == ""


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the `plot` extra were not installed
    with pytest.raises(ValueError, match=r"pipeserve\[plot\]"):
        bench_cli(["bench", "--url", "http://127.0.0.1:9", "--plot", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()


def test_multi_turn_workload_plots_every_turn(tmp_path):
    app, state = openai_app(ttft=0.01, itl=0.002)
    out_png = tmp_path / "turns.png"
    with Served(app) as srv:
        argv = ["bench", "--url", srv.url, "--workload", "multi-turn", "--num-conversations", "2"]
        argv += ["--num-turns", "2", "--concurrency", "2", "--input-len", "8", "--output-len", "4"]
        argv += ["--shared-prefix-len", "8", "--warmup", "0", "--plot", str(out_png)]
        assert bench_cli(argv) == 0
    assert state["count"] == 4
    assert out_png.read_bytes()[:8] == PNG_MAGIC
