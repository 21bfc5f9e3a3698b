"""Node failures: death mid-stream → SSE error event + [DONE] (fail closed) and ejection, next
request served by the other node; a node down before the start → fail-over, or (with
--fallback error) a clear 503 when none is left; health checks re-admit a node that comes back; a
failed hand-off reported by the node → (--fallback error) an error, never a truncated success.
What the default --fallback standard makes of the same failures: tests/router/test_fallback.py."""
import json
import time

import pytest
import requests

from nexrt_vllm.handoff.contracts import HandoffReport, HandoffStatus
from nexrt_vllm.handoff.protocol import Reason
from nexrt_vllm.testing.router_fakes import Stack, tokenizer_dir, wait


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return tokenizer_dir(tmp_path_factory)


@pytest.fixture
def stack(tok_dir):
    """stack(**kw): a Stack on the module's tokenizer, closed after the test (also when it fails)."""
    made = []

    def make(**kw):
        made.append(Stack(tok_dir, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def complete(url, stream, max_tokens=10):
    return requests.post(url + "/v1/completions", headers={"X-NexRT-Class": "interactive"},
                         timeout=30, json={"model": "tiny", "prompt": "fail over",
                                           "max_tokens": max_tokens, "stream": stream})


def sse(text):
    frames = [f for f in text.split("\n\n") if f]
    return [f[len("data: "):] for f in frames]


def test_node_dies_mid_stream_then_failover(stack):
    s = stack(n_nodes=2, router_args=("--health-interval", "60"))
    for n in s.nodes:
        n.die_after = 3
    r = complete(s.url, stream=True)
    assert r.status_code == 200
    frames = sse(r.text)
    assert frames[-1] == "[DONE]"
    err = json.loads(frames[-2])["error"]
    assert err["code"] == 502 and "decode node" in err["message"]
    assert sum(1 for f in frames[:-2] if json.loads(f)["choices"]) == 4   # 1 + 3 tokens
    dead = next(i for i, n in enumerate(s.router.pool.nodes) if not n.healthy)
    s.loop.stop_app(s.node_urls[dead])
    for n in s.nodes:
        n.die_after = None
    r = complete(s.url, stream=False)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10
    assert s.nodes[1 - dead].generated and not s.nodes[dead].generated
    h = s.health()
    assert [n["healthy"] for n in h["nodes"]] == [i != dead for i in range(2)]
    assert h["slots_busy"] == 0


def test_node_down_before_start(stack):
    # Health checks effectively off: the router learns of the dead node only at admission.
    s = stack(n_nodes=2, router_args=("--health-interval", "3600", "--fallback", "error"))
    s.loop.stop_app(s.node_urls[0])
    for _ in range(2):        # whichever node round-robin picks first, the request succeeds
        r = complete(s.url, stream=True)
        assert r.status_code == 200 and sse(r.text)[-1] == "[DONE]"
    assert len(s.nodes[1].generated) == 2
    assert [n["healthy"] for n in s.health()["nodes"]] == [False, True]
    s.loop.stop_app(s.node_urls[1])
    r = complete(s.url, stream=False)
    assert r.status_code == 503 and "no healthy decode node" in r.json()["error"]["message"]
    assert s.idle()


def test_health_checks_eject_and_readmit(stack):
    s = stack(n_nodes=2, router_args=("--health-interval", "0.1"))
    port = int(s.node_urls[0].rsplit(":", 1)[1])
    s.loop.stop_app(s.node_urls[0])
    wait(lambda: [n["healthy"] for n in s.health()["nodes"]] == [False, True])
    s.loop.serve(s.nodes[0].new_app(), port)
    wait(lambda: all(n["healthy"] for n in s.health()["nodes"]))
    r = complete(s.url, stream=False)
    assert r.status_code == 200


def test_failed_handoff_is_an_error(stack):
    s = stack(n_nodes=1, router_args=("--fallback", "error"))
    s.nodes[0].finish_error = "transfer aborted: sender vanished"
    r = complete(s.url, stream=False)
    assert r.status_code == 502 and "transfer aborted" in r.json()["error"]["message"]
    r = complete(s.url, stream=True)
    frames = sse(r.text)
    assert frames[-1] == "[DONE]" and "transfer aborted" in frames[-2]
    assert all(json.loads(f)["choices"][0]["finish_reason"] is None for f in frames[:-2])
    # A reported error is not a dead node: it stays in rotation.
    assert s.health()["nodes"][0]["healthy"] and s.idle()


def test_busy_node_is_retried_not_ejected(stack):
    # The node still finishes a request the router no longer owns (e.g. a cancel in progress):
    # admission is retried briefly instead of failing or ejecting the only node.
    s = stack(n_nodes=1, router_args=("--health-interval", "3600"))
    node = s.nodes[0]
    node.rid = "someone-else"
    s.loop.loop.call_later(0.4, setattr, node, "rid", None)
    t0 = time.monotonic()
    r = complete(s.url, stream=False)
    assert r.status_code == 200 and time.monotonic() - t0 >= 0.35
    assert s.health()["nodes"][0]["healthy"] and s.idle()


def test_connector_reported_handoff_failure(stack):
    # vLLM's answer says the connector could not hand the state over: clear 502 at once (no
    # wait for the node's transfer timeout), the node reservation is cancelled.
    s = stack(n_nodes=1, router_args=("--fallback", "error"))
    s.vllm.handoff_status = HandoffReport(HandoffStatus.FAILED, reason=Reason.TOO_LONG,
                                          error="seq_len 5000 exceeds max_seq_len 4096")
    for stream in (False, True):
        r = complete(s.url, stream=stream)
        assert r.status_code == 502 and "hand-off" in r.json()["error"]["message"]
        assert "too_long" in r.json()["error"]["message"]
    assert s.idle()
    assert len(s.nodes[0].cancels) == 2 and not s.nodes[0].generated
