"""Client disconnect at any stage: during prefill the vLLM request is closed (vLLM aborts it) and
the node reservation cancelled; during decode the node stops; the slot is released exactly once."""
import socket
import time

import pytest
import requests

from nexrt_vllm.testing.router_fakes import interactive_stack, wait


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from interactive_stack(tmp_path_factory)


def test_disconnect_during_prefill(stack):
    stack.vllm.delay = 3.0
    node = stack.nodes[0]
    admits, aborted = node.admits, stack.vllm.aborted
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(stack.url + "/v1/completions", timeout=0.5, json={
            "model": "tiny", "prompt": "slow prefill", "max_tokens": 8, "stream": True})
    wait(lambda: stack.vllm.aborted == aborted + 1)          # vLLM saw its request closed
    assert node.admits == admits + 1
    assert stack.idle()
    assert node.rid is None and node.cancels[-1]             # reservation cancelled
    stack.vllm.delay = 0.0
    # The node is usable again at once.
    r = requests.post(stack.url + "/v1/completions", timeout=10,
                      json={"model": "tiny", "prompt": "after", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_disconnect_during_decode(stack):
    node = stack.nodes[0]
    node.token_delay = 0.05
    gen = len(node.generated)
    body = b'{"model":"tiny","prompt":"long decode","max_tokens":200,"stream":true}'
    host, port = stack.url[len("http://"):].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while got.count(b"data: ") < 4:                  # a few tokens streamed
            got += sock.recv(4096)
    assert stack.idle()
    node.token_delay = 0.0
    assert node.rid is None and len(node.generated) == gen   # decode stopped early
    assert len(node.emit_times) < 200


def test_disconnect_while_the_node_admits(stack):
    """The node has reserved its slot but its admit answer is not out when the client leaves: the
    router still cancels that reservation, so the slot is not held until the node's begin
    deadline (the next request is admitted at once)."""
    node = stack.nodes[0]
    node.admit_delay = 1.0
    cancels = len(node.cancels)
    try:
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(stack.url + "/v1/completions", timeout=0.3, json={
                "model": "tiny", "prompt": "leave during admit", "max_tokens": 8})
        wait(lambda: node.rid is None, timeout=3)
        assert len(node.cancels) == cancels + 1
    finally:
        node.admit_delay = 0.0
    assert stack.idle()
    t0 = time.monotonic()
    r = requests.post(stack.url + "/v1/completions", timeout=10,
                      json={"model": "tiny", "prompt": "next", "max_tokens": 4})
    assert r.status_code == 200 and "x-nexrt-degraded" not in r.headers
    assert time.monotonic() - t0 < 1.0
