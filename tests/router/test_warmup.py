"""Warm-up hand-offs on the test doubles: the router sends one probe hand-off (admit, claimed
one-token prefill, a node decode of one token) to every node it takes into rotation — at start,
before it serves, and whenever a node comes back, restarts (another `instance` in its /health) or
meets a restarted vLLM (another connector `instance`). Counted in nexrt_router_warmups_total
only; a failed or timed-out warm-up is logged and leaves the node in rotation with its slot free;
a user request arriving meanwhile is served once the probe is done; --no-warmup sends none.
The real path (a restarted node's first hand-off as fast as its second): test_warmup_real.py."""
import logging
import time

import pytest
import requests

from nexrt_vllm.handoff.contracts import HandoffReport, HandoffStatus
from nexrt_vllm.handoff.protocol import Reason
from nexrt_vllm.testing.real_stack import metric
from nexrt_vllm.testing.router_fakes import Stack, tokenizer_dir, wait


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return tokenizer_dir(tmp_path_factory)


@pytest.fixture
def stack(tok_dir):
    made = []

    def make(n_nodes=1, *args, warmup=True):
        made.append(Stack(tok_dir, n_nodes=n_nodes, warmup=warmup,
                          router_args=("--default-class", "interactive", *args)))
        return made[-1]

    yield make
    for s in made:
        s.close()


def warmups(url, outcome="ok"):
    return metric(url, "nexrt_router_warmups_total", f'outcome="{outcome}"')


def another_router(s, *args):
    """A router with warm-up over the doubles of `s` (set up before it starts); -> (url, Router)."""
    from nexrt_vllm.router.server import ROUTER_KEY, build_parser, make_app

    argv = ["--vllm-url", s.vllm_url, "--default-class", "interactive", *args]
    for u in s.node_urls:
        argv += ["--decode-url", u]
    app = make_app(build_parser().parse_args(argv))
    return s.loop.serve(app), app[ROUTER_KEY]


def claimed(s):
    """The prefill legs vLLM got with a claim (warm-ups and interactive requests)."""
    return [b for b in s.vllm.requests if "kv_transfer_params" in b]


def complete(s, prompt="warm path"):
    return requests.post(s.url + "/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 5})


def test_every_node_is_warmed_before_the_router_serves(stack):
    s = stack(2)
    # start() returned only after both probes: each node admitted, got its state and decoded.
    assert [n.admits for n in s.nodes] == [1, 1]
    assert all(len(n.generated) == 1 and n.rid is None for n in s.nodes)
    legs = claimed(s)
    assert len(legs) == 2 and all(b["max_tokens"] == 1 and b["return_token_ids"] for b in legs)
    assert {b["kv_transfer_params"]["nexrt"]["node_url"] for b in legs} == set(s.node_urls)
    assert warmups(s.url) == 2 and warmups(s.url, "failed") == warmups(s.url, "timeout") == 0
    assert [n["warmup"] for n in s.health()["nodes"]] == ["ok", "ok"]
    # Not a request: none of the user-facing metrics saw it, nor the Retry-After estimate.
    assert metric(s.url, "nexrt_router_ttft_seconds_count") == 0
    assert metric(s.url, "nexrt_router_generated_tokens_total") == 0
    assert metric(s.url, "nexrt_router_fast_path_failures_total") == 0
    assert "nexrt_router_requests_total{" not in requests.get(s.url + "/metrics").text
    assert all(not n.service_times for n in s.router.pool.nodes)
    assert s.idle()


def test_no_warmup_flag(stack):
    s = stack(1, warmup=False)
    assert s.nodes[0].admits == 0 and not s.vllm.requests
    assert warmups(s.url) == 0 and s.health()["nodes"][0]["warmup"] is None


def test_a_node_back_in_rotation_is_warmed_again(stack):
    s = stack(1)
    node, url = s.nodes[0], s.node_urls[0]
    s.loop.stop_app(url)
    wait(lambda: not s.health()["nodes"][0]["healthy"])
    s.loop.serve(node.new_app(), int(url.rsplit(":", 1)[1]))
    wait(lambda: warmups(s.url) == 2)
    assert node.admits == 2 and len(node.generated) == 2
    r = complete(s)
    assert r.status_code == 200 and "degraded" not in r.json()["nexrt_timing"]
    assert warmups(s.url) == 2 and node.admits == 3


def test_a_restart_between_two_health_checks_is_warmed(stack):
    """The node never looked down, but its /health names another process: it restarted."""
    s = stack(1)
    s.nodes[0].instance = "second-process"
    wait(lambda: warmups(s.url) == 2)
    assert s.nodes[0].admits == 2
    time.sleep(0.5)                          # later rounds: same instance, no more warm-ups
    assert warmups(s.url) == 2


def test_a_restarted_vllm_warms_every_node(stack):
    s = stack(2)
    s.vllm.connector = {**s.vllm.connector, "instance": "vllm-2"}
    s.router.node_health.reprobe()           # as after a failure that showed vLLM unreachable
    wait(lambda: warmups(s.url) == 4, timeout=15)   # a probe at most every REPROBE_MIN_S
    assert [n.admits for n in s.nodes] == [2, 2]


@pytest.mark.parametrize("fault", ["connector", "node"])
def test_a_failed_warmup_changes_nothing_else(stack, caplog, fault):
    caplog.set_level(logging.WARNING, logger="nexrt.router")
    s = stack(1, warmup=False)
    if fault == "connector":
        s.vllm.handoff_status = HandoffReport(HandoffStatus.FAILED, reason=Reason.BUSY, error="node refused")
    else:
        s.nodes[0].refuse = (Reason.UNKNOWN_RID, "forgot it")
    url, rt = another_router(s)
    assert warmups(url, "failed") == 1 and warmups(url) == 0 and len(claimed(s)) == 1
    assert rt.pool.nodes[0].healthy and not rt.pool.nodes[0].busy and rt.pool.nodes[0].warmup == "failed"
    assert any("warm-up of decode node" in r.getMessage() and "stays in rotation" in r.getMessage()
               for r in caplog.records)
    assert s.nodes[0].rid is None            # the reservation was cancelled, or ended by the node
    s.vllm.handoff_status, s.nodes[0].refuse = None, None
    r = requests.post(url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": "after",
                                                                 "max_tokens": 5})
    assert r.status_code == 200 and "degraded" not in r.json()["nexrt_timing"]
    assert metric(url, "nexrt_router_degraded_total") == 0


def test_a_transfer_failure_is_tried_once_more(stack):
    """A failed transfer means the sender dropped a stale connection (a node restarted behind the
    same control address): a second probe sets up a fresh one. Other failures are not retried."""
    s = stack(1, warmup=False)
    s.vllm.handoff_status = HandoffReport(HandoffStatus.FAILED, reason=Reason.TRANSFER_FAILED, error="rc=-1")
    url, rt = another_router(s)
    assert len(claimed(s)) == 2 and warmups(url, "failed") == 1
    assert s.nodes[0].rid is None and not rt.pool.nodes[0].busy


def test_a_warmup_is_bounded_by_its_timeout(stack):
    s = stack(1, warmup=False)
    s.nodes[0].token_delay = 5.0             # the probe's decoded token would take 5 s
    t0 = time.monotonic()
    url, rt = another_router(s, "--warmup-timeout", "0.5")
    assert time.monotonic() - t0 < 4.0
    assert warmups(url, "timeout") == 1
    node = rt.pool.nodes[0]
    assert node.healthy and not node.busy and node.warmup == "timeout"
    assert s.nodes[0].rid is None            # the probe's stream was closed, its admission freed


def test_a_request_during_a_warmup_waits_only_for_it(stack):
    s = stack(1)
    node, url = s.nodes[0], s.node_urls[0]
    s.loop.stop_app(url)
    wait(lambda: not s.health()["nodes"][0]["healthy"])
    node.token_delay = 1.0                   # the probe holds the node for about a second
    s.loop.serve(node.new_app(), int(url.rsplit(":", 1)[1]))
    wait(lambda: s.router.pool.nodes[0].busy)   # the warm-up holds the slot
    node.token_delay = 0.0
    t0 = time.monotonic()
    r = complete(s, "while warming")
    assert r.status_code == 200
    t = r.json()["nexrt_timing"]
    assert "degraded" not in t and t["queue_s"] < 1.5
    assert time.monotonic() - t0 < 3.0
    assert warmups(s.url) == 2
