"""Backpressure: 1 node, queue of 2 → the 4th concurrent request gets 429 + Retry-After with an
OpenAI error body; queued requests are served in FIFO order; queue-timeout expiry → 429; after
all, no slot is busy (slots are released at stream end, not at header time)."""
import threading
import time

import pytest
import requests

from nexrt_vllm.testing import make_tokenizer
from nexrt_vllm.testing.router_fakes import Stack


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    make_tokenizer(d)
    return d


def post(url, tag, results, stream=False):
    r = requests.post(url + "/v1/completions", headers={"X-NexRT-Class": "interactive"}, json={
        "model": "tiny", "prompt": f"request {tag}", "max_tokens": 8, "user": tag,
        "stream": stream}, timeout=60)
    results[tag] = (r.status_code, r.headers.get("Retry-After"), r.text, time.monotonic())


def metric(url, name):
    for line in requests.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_queue_full_429_and_fifo(tok_dir):
    s = Stack(tok_dir, n_nodes=1, router_args=("--queue-size", "2", "--queue-timeout", "30"))
    try:
        s.nodes[0].token_delay = 0.1           # each request holds the node ~0.7 s
        results, threads = {}, []
        for i, tag in enumerate(["a", "b", "c"]):
            t = threading.Thread(target=post, args=(s.url, tag, results, i == 0))
            t.start()
            threads.append(t)
            # Wait until it is running/queued so that arrival order is well defined.
            deadline = time.monotonic() + 30
            while s.health()["slots_busy"] + s.health()["queue_depth"] < i + 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        h = s.health()
        assert h["slots_busy"] == 1 and h["queue_depth"] == 2
        post(s.url, "d", results)
        status, retry_after, body, _ = results["d"]
        assert status == 429 and int(retry_after) >= 1
        err = requests.models.complexjson.loads(body)["error"]
        assert err["code"] == 429 and "queue is full" in err["message"]
        for t in threads:
            t.join(30)
        assert [results[t][0] for t in "abc"] == [200, 200, 200]
        # FIFO: prefill legs (one per admission) ran in arrival order, and so did completions.
        assert [b["user"] for b in s.vllm.requests] == ["a", "b", "c"]
        assert results["a"][3] < results["b"][3] < results["c"][3]
        assert s.idle() and s.health()["queue_depth"] == 0
        assert metric(s.url, "nexrt_router_inflight") == 0
        assert metric(s.url, 'nexrt_router_rejected_total{reason="queue_full"}') == 1
    finally:
        s.close()


def test_queue_timeout_429(tok_dir):
    s = Stack(tok_dir, n_nodes=1, router_args=("--queue-size", "4", "--queue-timeout", "0.3"))
    try:
        s.nodes[0].token_delay = 0.15          # ~1 s on the node
        results = {}
        t = threading.Thread(target=post, args=(s.url, "long", results))
        t.start()
        deadline = time.monotonic() + 30
        while s.health()["slots_busy"] < 1:
            assert time.monotonic() < deadline, "the long request never took the node"
            time.sleep(0.01)
        t0 = time.monotonic()
        post(s.url, "late", results)
        status, retry_after, body, t1 = results["late"]
        assert status == 429 and retry_after is not None
        assert 0.25 <= t1 - t0 < 2.0
        assert "within 0.3s" in body
        t.join(30)
        assert results["long"][0] == 200
        assert s.idle() and s.health()["queue_depth"] == 0
    finally:
        s.close()
