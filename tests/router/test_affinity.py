"""Conversation affinity (router/affinity.py): a conversation is named by `x-session-id`, else
`user`, else its leading chat messages; its next turn goes to the node that served its last one
when that node is free (it holds the context), else to another node; counted in
`nexrt_router_affinity`."""
import threading

import pytest
import requests

from nexrt_vllm.router.affinity import Affinity, session_key
from nexrt_vllm.testing import make_tokenizer
from nexrt_vllm.testing.router_fakes import Stack, wait

SYSTEM = {"role": "system", "content": "you are an agent"}


def test_what_names_a_conversation():
    t1 = [SYSTEM, {"role": "user", "content": "fix the bug"}]
    t2 = t1 + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "now test it"}]
    chat = session_key({}, {"messages": t1}, "chat")
    assert chat is not None and chat == session_key({}, {"messages": t2}, "chat")  # the same conversation
    assert session_key({}, {"messages": [SYSTEM, {"role": "user", "content": "other"}]}, "chat") != chat
    assert session_key({}, {"messages": [SYSTEM]}, "chat") is None
    assert session_key({}, {"messages": t1, "user": "u7"}, "chat") == "user:u7"
    assert session_key({"x-session-id": "s1"}, {"messages": t1, "user": "u7"}, "chat") == "session:s1"
    assert session_key({}, {"prompt": "a long prompt"}, "completion") is None  # no turns in a raw prompt
    assert session_key({}, {"prompt": "p", "user": "u7"}, "completion") == "user:u7"


def test_the_map_is_bounded():
    a = Affinity(size=2)
    for k in "abc":
        a.served(k, f"http://{k}")
    assert len(a) == 2 and a.node_for("a") is None and a.node_for("c") == "http://c"
    a.served(None, "http://x")
    assert a.node_for(None) is None and len(a) == 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    make_tokenizer(d)
    s = Stack(d, n_nodes=2, router_args=("--default-class", "interactive"))
    wait(lambda: all(n["healthy"] for n in s.health()["nodes"]), 10)
    yield s
    s.close()


def chat(stack, messages, **headers):
    r = requests.post(stack.url + "/v1/chat/completions", headers=headers, timeout=60, json={
        "model": "tiny", "messages": messages, "max_tokens": 6})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def affinity(stack, outcome):
    for line in requests.get(stack.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(f'nexrt_router_affinity_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    raise AssertionError("nexrt_router_affinity_total not exported")


def admits(stack):
    return [n.admits for n in stack.nodes]


def test_next_turns_go_to_the_node_of_the_last(stack):
    msgs = [SYSTEM, {"role": "user", "content": "hello there"}]
    before = admits(stack)
    answer = chat(stack, msgs)
    first = next(i for i, (a, b) in enumerate(zip(admits(stack), before)) if a != b)
    for k in range(3):  # round robin alone would alternate
        msgs = msgs + [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and then {k}"}]
        answer = chat(stack, msgs)
    got = [a - b for a, b in zip(admits(stack), before)]
    assert got[first] == 4 and got[1 - first] == 0
    assert affinity(stack, "same") == 3 and affinity(stack, "new") >= 1


def test_a_busy_node_gives_the_turn_to_another(stack):
    msgs = [SYSTEM, {"role": "user", "content": "second conversation"}]
    before = admits(stack)
    chat(stack, msgs, **{"x-session-id": "conv-b"})
    home = next(i for i, (a, b) in enumerate(zip(admits(stack), before)) if a != b)
    other_before = affinity(stack, "other")
    # another conversation whose last turn was on the home node holds it now
    stack.router.interactive.affinity.served("session:conv-c", stack.node_urls[home])
    stack.nodes[home].token_delay = 0.3
    blocker = threading.Thread(target=chat, args=(stack, [SYSTEM, {"role": "user", "content": "long one"}]),
                               kwargs={"x-session-id": "conv-c"})
    blocker.start()
    try:
        wait(lambda: stack.nodes[home].rid is not None, 10)
        before = admits(stack)
        chat(stack, msgs + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}],
             **{"x-session-id": "conv-b"})
        assert [a - b for a, b in zip(admits(stack), before)] == [int(i != home) for i in range(2)]
        assert affinity(stack, "other") == other_before + 1
    finally:
        blocker.join(30)
        stack.nodes[home].token_delay = 0.0
    assert stack.idle()
