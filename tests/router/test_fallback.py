"""Router policies when the fast tier cannot serve (against test doubles of vLLM and the nodes;
the real stack: tests/router/test_degrade.py): every failure before the node's text reaches the
client continues on the standard path (one ordinary response, the model's own continuation,
`x-nexrt-degraded` + `nexrt_timing.degraded`, `degraded_total{reason}`), decided at once; after
node text was streamed, fail closed; `--fallback error` gives the errors; `--when-busy`;
misconfigured nodes ejected with the mismatch named; Retry-After from the queue."""
import json
import math
import threading
import time

import pytest
import requests

from nexrt_vllm.handoff.contracts import HandoffReport, HandoffStatus
from nexrt_vllm.handoff.protocol import Reason
from nexrt_vllm.router.pool import NodePool
from nexrt_vllm.testing.router_fakes import Stack, tokenizer_dir, wait

HDR = {"X-NexRT-Class": "interactive"}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return tokenizer_dir(tmp_path_factory)


def metric(url, name):
    for line in requests.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def degraded(url, reason):
    return metric(url, f'nexrt_router_degraded_total{{reason="{reason}"}}')


def post(s, kind="completion", stream=False, max_tokens=10, timeout=30, **extra):
    body = {"model": "tiny", "max_tokens": max_tokens, "stream": stream, **extra}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "fall back please"}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = "fall back please"
        path = "/v1/completions"
    return requests.post(s.url + path, headers=HDR, json=body, timeout=timeout)


def expected(s, kind, n):
    m = s.model
    prompt = m.tok.encode("fall back please").ids
    toks = m.continuation(prompt, n)
    full = m.tok.decode(prompt + toks, skip_special_tokens=True)
    return toks, full[len(m.tok.decode(prompt, skip_special_tokens=True)):]


def sse(r):
    frames = [f[len("data: "):] for f in r.text.split("\n\n") if f]
    assert frames[-1] == "[DONE]", frames[-3:]
    return [json.loads(f) for f in frames[:-1]]


def text_of(chunks, kind):
    if kind == "chat":
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def check_served(s, r, kind, stream, reason, n=10, header=True):
    """200, the model's own tokens/text, the reason in the header and nexrt_timing, decided fast."""
    assert r.status_code == 200, r.text
    if header:
        assert r.headers.get("x-nexrt-degraded") == reason
    toks, text = expected(s, kind, n)
    if stream:
        chunks = sse(r)
        assert not any("error" in c for c in chunks), chunks
        assert text_of(chunks, kind) == text
        timing = chunks[-1]["nexrt_timing"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        body = r.json()
        choice = body["choices"][0]
        assert (choice["message"]["content"] if kind == "chat" else choice["text"]) == text
        assert body["usage"]["completion_tokens"] == n
        timing = body["nexrt_timing"]
    d = timing["degraded"]
    assert d["reason"] == reason and d["decide_s"] < 1.0 and d["fallback_at"] - d["known_at"] < 1.0
    return d


@pytest.mark.parametrize("kind,stream", [("completion", False), ("completion", True),
                                         ("chat", False), ("chat", True)])
def test_no_healthy_node_uses_the_standard_path(tok_dir, kind, stream):
    s = Stack(tok_dir, n_nodes=1, router_args=("--health-interval", "0.1"))
    try:
        s.loop.stop_app(s.node_urls[0])
        wait(lambda: not s.health()["nodes"][0]["healthy"])
        h = s.health()
        assert h["status"] == "degraded" and requests.get(s.url + "/health").status_code == 200
        t0 = time.monotonic()
        r = post(s, kind, stream, return_token_ids=not stream or None)
        check_served(s, r, kind, stream, "no_node")
        assert time.monotonic() - t0 < 2.0
        if not stream:
            assert r.json()["choices"][0]["token_ids"] == expected(s, kind, 10)[0]
        assert degraded(s.url, "no_node") == 1
        assert metric(s.url, 'nexrt_router_fast_path_failures_total{reason="no_node"}') == 1
        # The standard leg: the client's prompt, streamed with token ids, no claim.
        b = s.vllm.standard[-1]
        assert "kv_transfer_params" not in b and b["return_token_ids"] and b["max_tokens"] == 10
        assert not s.vllm.handoff
    finally:
        s.close()


def test_connector_reported_failure_continues_after_the_first_token(tok_dir):
    s = Stack(tok_dir, n_nodes=1)
    try:
        s.vllm.handoff_status = HandoffReport(HandoffStatus.FAILED, "r", 1, 3, Reason.TRANSFER_FAILED,
                                              "not a mooncake peer")
        for stream in (False, True):
            r = post(s, "completion", stream)
            d = check_served(s, r, "completion", stream, "handoff")
            assert "not a mooncake peer" in d["detail"]
            # The rest came from a continuation of prompt + vLLM's first token.
            first = expected(s, "completion", 1)[0]
            assert s.vllm.standard[-1]["prompt"] == s.model.tok.encode("fall back please").ids + first
            assert s.vllm.standard[-1]["max_tokens"] == 9
        assert s.idle() and len(s.nodes[0].cancels) == 2 and not s.nodes[0].generated
        assert degraded(s.url, "handoff") == 2
        assert s.health()["nodes"][0]["healthy"]
    finally:
        s.close()


def test_node_refusal_is_not_a_dead_node(tok_dir):
    s = Stack(tok_dir, n_nodes=1)
    try:
        s.nodes[0].refuse = (Reason.STALE_GENERATION, "generation 3, admission is 4")
        for kind, stream in (("completion", True), ("chat", False)):
            r = post(s, kind, stream)
            d = check_served(s, r, kind, stream, "handoff", header=False)
            assert "stale_generation" in d["detail"]
        assert s.health()["nodes"][0]["healthy"] and s.idle()
        s.nodes[0].refuse = None
        assert post(s).headers.get("x-nexrt-degraded") is None
    finally:
        s.close()


@pytest.mark.parametrize("stream", [False, True])
def test_node_dies_before_its_first_token(tok_dir, stream):
    s = Stack(tok_dir, n_nodes=1, router_args=("--health-interval", "60"))
    try:
        s.nodes[0].die_after = 0
        r = post(s, "completion", stream)
        check_served(s, r, "completion", stream, "node_failed", header=False)
        assert not s.health()["nodes"][0]["healthy"] and s.idle()
    finally:
        s.close()


def test_node_dies_after_streaming_fails_closed_but_json_completes(tok_dir):
    s = Stack(tok_dir, n_nodes=1, router_args=("--health-interval", "0.1"))
    try:
        s.nodes[0].die_after = 3
        r = post(s, "completion", stream=True)
        chunks = sse(r)
        assert chunks[-1]["error"]["code"] == 502 and "decode node" in chunks[-1]["error"]["message"]
        assert degraded(s.url, "node_failed") == 0
        wait(lambda: s.health()["nodes"][0]["healthy"])
        # Nothing reached a non-streaming client yet: the standard path finishes it.
        r = post(s, "completion", stream=False, return_token_ids=True)
        check_served(s, r, "completion", False, "node_failed", header=False)
        assert r.json()["choices"][0]["token_ids"] == expected(s, "completion", 10)[0]
        assert s.vllm.standard[-1]["max_tokens"] == 6     # 1 + 3 tokens came before the death
    finally:
        s.close()


def _hold_node(s, results):
    s.nodes[0].token_delay = 0.2
    t = threading.Thread(target=lambda: results.append(post(s, max_tokens=8)))
    t.start()
    wait(lambda: s.health()["slots_busy"] == 1)
    return t


def test_when_busy_standard_and_429(tok_dir):
    s = Stack(tok_dir, n_nodes=1, router_args=("--when-busy", "standard"))
    try:
        held = []
        t = _hold_node(s, held)
        t0 = time.monotonic()
        r = post(s, "chat", stream=True)
        assert time.monotonic() - t0 < 1.0
        check_served(s, r, "chat", True, "busy")
        t.join(10)
        assert held[0].status_code == 200 and degraded(s.url, "busy") == 1
    finally:
        s.close()
    s = Stack(tok_dir, n_nodes=1, router_args=("--when-busy", "429"))
    try:
        held = []
        t = _hold_node(s, held)
        r = post(s)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert "busy" in r.json()["error"]["message"]
        assert metric(s.url, 'nexrt_router_rejected_total{reason="busy"}') == 1
        t.join(10)
    finally:
        s.close()


def test_fallback_error_gives_the_errors_at_once(tok_dir):
    s = Stack(tok_dir, n_nodes=1, router_args=("--fallback", "error", "--health-interval", "0.1"))
    try:
        s.vllm.handoff_status = HandoffReport(HandoffStatus.FAILED, reason=Reason.BUSY, error="refused")
        t0 = time.monotonic()
        r = post(s, stream=True)
        assert r.status_code == 502 and "hand-off" in r.json()["error"]["message"]
        s.vllm.handoff_status = None
        s.nodes[0].refuse = (Reason.UNKNOWN_RID, "rid was not admitted")
        r = post(s, stream=False)
        assert r.status_code == 502 and "refused to decode" in r.json()["error"]["message"]
        s.nodes[0].refuse = None
        s.nodes[0].max_seq_len = 8
        time.sleep(0.3)
        r = post(s, max_tokens=20)
        assert r.status_code == 400 and "maximum context length is 8" in r.json()["error"]["message"]
        s.nodes[0].max_seq_len = 4096
        s.loop.stop_app(s.node_urls[0])
        wait(lambda: not s.health()["nodes"][0]["healthy"])
        r = post(s)
        assert r.status_code == 503 and "no healthy decode node" in r.json()["error"]["message"]
        assert requests.get(s.url + "/health").status_code == 503
        assert time.monotonic() - t0 < 5.0 and not s.vllm.standard
        assert metric(s.url, 'nexrt_router_fast_path_failures_total{reason="handoff"}') == 2
        assert degraded(s.url, "handoff") == 0
    finally:
        s.close()
    with pytest.raises(SystemExit):
        Stack(tok_dir, router_args=("--fallback", "error", "--when-busy", "standard"))


def test_prefill_failure_degrades_only_to_another_server(tok_dir):
    other = Stack(tok_dir, n_nodes=1)             # its vLLM double serves as the standard pool
    s = Stack(tok_dir, n_nodes=1, router_args=("--standard-url", other.vllm_url))
    try:
        s.vllm.prefill_error = 500
        r = post(s, "completion", stream=False)
        check_served(s, r, "completion", False, "prefill")
        assert other.vllm.standard and not s.vllm.standard and s.idle()
        assert s.nodes[0].cancels                 # the reservation was released
    finally:
        s.close()
        other.close()
    s = Stack(tok_dir, n_nodes=1)                 # the standard path is the same (failed) vLLM
    try:
        s.vllm.prefill_error = 500
        r = post(s, "completion", stream=False)
        assert r.status_code == 502 and "engine dead" in r.json()["error"]["message"]
        assert not s.vllm.standard and s.idle()
    finally:
        s.close()


@pytest.mark.parametrize("caps,connector,needle", [
    ({"transport": {"backend": "nixl"}}, {"transport": "mooncake"}, "transport: the connector sends with mooncake"),
    ({"num_hidden_layers": 8}, {"model": {"name": "tiny", "num_hidden_layers": 4}}, "num_hidden_layers=4 vs 8"),
    ({"dtype": "float16"}, {"dtype": "bfloat16"}, "dtype: vLLM computes in bfloat16, the node in float16"),
    ({"protocol_version": 2}, {"protocol_version": 3}, "protocol_version"),
    ({}, None, "runs no NexRTConnector"),
])
def test_misconfigured_node_is_ejected_at_start(tok_dir, caplog, caps, connector, needle):
    from nexrt_vllm.testing import router_fakes

    orig = router_fakes.FakeVLLM.__init__

    def patched(self, *a, **kw):
        orig(self, *a, **kw)
        self.connector = connector

    router_fakes.FakeVLLM.__init__ = patched
    try:
        with caplog.at_level("ERROR", logger="nexrt.router"):
            s = Stack(tok_dir, n_nodes=2, router_args=("--health-interval", "0.1"))
    finally:
        router_fakes.FakeVLLM.__init__ = orig
    try:
        s.nodes[1].caps_extra = dict(caps)    # node 0 is in order unless vLLM has no connector
        for n in s.nodes:
            n.caps_extra = dict(caps) if connector is None or n is s.nodes[1] else {}
        wait(lambda: not s.health()["nodes"][1]["healthy"])
        node = s.health()["nodes"][1]
        assert needle in node["reason"] and any(needle in m for m in node["mismatch"])
        assert any(needle in r.getMessage() and "does not match" in r.getMessage() for r in caplog.records)
        assert metric(s.url, "nexrt_router_nodes_misconfigured") == (2 if connector is None else 1)
        r = post(s)
        if connector is None:
            check_served(s, r, "completion", False, "no_node")
        else:
            assert r.status_code == 200 and s.nodes[0].generated and not s.nodes[1].admits
        # Mended on the node side: back in rotation at the next health check.
        for n in s.nodes:
            n.caps_extra = {}
        if connector is not None:
            wait(lambda: s.health()["nodes"][1]["healthy"])
    finally:
        s.close()


def test_retry_after_is_queue_position_times_service_time():
    pool = NodePool(["http://a", "http://b"], queue_size=8, queue_timeout=30, retry_after_max=60)
    a, b = pool.nodes
    a.healthy = b.healthy = True
    assert pool.retry_after(1) == 1                       # nothing measured yet: 1 s each, 2 nodes
    for _ in range(4):
        pool.record_service_time(a, 2.0)
        pool.record_service_time(b, 6.0)
    # Rate 1/2 + 1/6 = 2/3 requests/s: position k waits 1.5 k seconds.
    assert pool.expected_wait(4) == pytest.approx(6.0)
    assert pool.retry_after(4) == 6 and pool.retry_after(7) == 11
    b.healthy = False                                     # only a (2 s) serves now
    assert pool.retry_after(4) == 8
    assert pool.retry_after(1000) == 60                   # bounded above
    a.service_times.clear()
    pool.record_service_time(a, 0.01)
    assert pool.retry_after(1) == 1                       # and below
    # "Recent": only the last SERVICE_WINDOW requests count.
    for _ in range(100):
        pool.record_service_time(a, 3.0)
    assert pool.expected_wait(1) == pytest.approx(3.0)


def test_retry_after_of_a_full_queue_follows_the_queue(tok_dir):
    s = Stack(tok_dir, n_nodes=1, router_args=("--queue-size", "2", "--queue-timeout", "30"))
    try:
        node = s.nodes[0]
        node.token_delay = 0.1
        for _ in range(2):                           # measured service time: ~1 s (10 tokens)
            assert post(s).status_code == 200
        per = sum(s.router.pool.nodes[0].service_times) / 2
        assert 0.8 < per < 2.0
        results, threads = [], []
        for i in range(3):                           # one on the node, two queued
            threads.append(threading.Thread(target=lambda: results.append(post(s))))
            threads[-1].start()
            wait(lambda: s.health()["slots_busy"] + s.health()["queue_depth"] == i + 1)
        r = post(s)
        # Position 3 (two queued ahead) at the measured mean service time, on one node.
        assert r.status_code == 429 and int(r.headers["Retry-After"]) == math.ceil(3 * per)
        for t in threads:
            t.join(30)
        assert [x.status_code for x in results] == [200] * 3
    finally:
        s.close()


def test_prompt_beyond_the_node_context_without_max_tokens(tok_dir):
    """No max_tokens and a prompt the node cannot even hold: vLLM's context decides the length."""
    s = Stack(tok_dir, n_nodes=1)
    try:
        s.vllm.max_model_len = 24
        s.nodes[0].max_seq_len = 4
        time.sleep(0.5)
        prompt = "a b c d e f"
        r = requests.post(s.url + "/v1/completions", headers=HDR, timeout=10, json={
            "model": "tiny", "prompt": prompt, "return_token_ids": True})
        assert r.status_code == 200, r.text
        ids = s.model.tok.encode(prompt).ids
        assert r.headers["x-nexrt-degraded"] == "too_long"
        assert r.json()["choices"][0]["token_ids"] == s.model.continuation(ids, 24 - len(ids))
        assert s.idle()
    finally:
        s.close()


@pytest.mark.parametrize("extra,needle", [({"logprobs": 2}, "does not return logprobs"),
                                          ({"structured_outputs": {"regex": "[a-z]+"}},
                                           "does not support structured output 'regex'")])
def test_node_without_the_output_option(tok_dir, extra, needle):
    """A node whose /capabilities lack logprobs / the grammar type (this double lists neither):
    `unsupported`, decided before any admission — a 400 saying why with --fallback error, else
    the client's request goes unchanged to the standard path (vLLM's own logprobs and grammar)."""
    for policy in ("error", "standard"):
        s = Stack(tok_dir, n_nodes=1, router_args=("--fallback", policy))
        try:
            r = post(s, **extra)
            if policy == "error":
                assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
            else:
                assert r.status_code == 200 and r.headers["x-nexrt-degraded"] == "unsupported", r.text
                assert s.vllm.requests[-1] == {"model": "tiny", "max_tokens": 10, "stream": False,
                                               "prompt": "fall back please", **extra}
                assert degraded(s.url, "unsupported") == 1
            assert s.nodes[0].admits == 0 and s.idle()
            assert metric(s.url, 'nexrt_router_fast_path_failures_total{reason="unsupported"}') == 1
        finally:
            s.close()
