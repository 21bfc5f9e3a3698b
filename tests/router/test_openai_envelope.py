"""OpenAI surface of the interactive path (against test doubles of vLLM and the node): the openai
client works for chat and completions, streaming and not; SSE framing; usage; stop strings, stop
ids, EOS, ignore_eos, max_tokens=1; the prefill leg's rewritten body."""
import json

import openai
import pytest
import requests

from nexrt_vllm.testing.router_fakes import interactive_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from interactive_stack(tmp_path_factory)


@pytest.fixture(autouse=True)
def reset(stack):
    stack.model.eos_at = None
    yield
    assert stack.idle()


def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)


def expected(stack, body, n, ignore_eos=False):
    m = stack.model
    p = m.prompt_ids(body)
    toks = m.continuation(p, n, ignore_eos)
    text_toks = toks[:-1] if toks and toks[-1] == m.eos and not ignore_eos else toks
    full = m.tok.decode(p + text_toks, skip_special_tokens=True)
    return full[len(m.tok.decode(p, skip_special_tokens=True)):], toks


MSG = [{"role": "user", "content": "tell me a story"}]


def test_chat_non_streaming(stack):
    text, toks = expected(stack, {"messages": MSG}, 12)
    r = client(stack).chat.completions.create(model="tiny", messages=MSG, max_tokens=12,
                                              temperature=0)
    assert r.choices[0].message.content == text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(
        stack.model.prompt_ids({"messages": MSG}))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_streaming_envelope(stack):
    text, _ = expected(stack, {"messages": MSG}, 10)
    chunks = list(client(stack).chat.completions.create(
        model="tiny", messages=MSG, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_completions_streaming_and_not(stack):
    body = {"prompt": "once upon a time"}
    text, _ = expected(stack, body, 9)
    c = client(stack)
    r = c.completions.create(model="tiny", prompt=body["prompt"], max_tokens=9, temperature=0)
    assert r.choices[0].text == text and r.usage.completion_tokens == 9
    chunks = list(c.completions.create(model="tiny", prompt=body["prompt"], max_tokens=9,
                                       temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.usage is None for ch in chunks)     # no usage chunk unless asked for


def test_raw_sse_framing(stack):
    r = requests.post(stack.url + "/v1/completions", json={
        "model": "tiny", "prompt": "abc", "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}}, timeout=30)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    frames = r.text.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    objs = [json.loads(f[len("data: "):]) for f in frames[:-2]]
    assert all(f.startswith("data: ") for f in frames[:-1])
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 4
    assert objs[-2]["choices"][0]["finish_reason"] == "length"


def test_prefill_leg_body(stack):
    stack.vllm.requests.clear()
    client(stack).chat.completions.create(model="tiny", messages=MSG, max_tokens=5,
                                          stop=["zzz"], user="u1", stream=True).close()
    b = stack.vllm.requests[-1]
    assert b["max_tokens"] == 1 and b["stream"] is False and b["return_token_ids"] is True
    assert "stop" not in b and "stream_options" not in b and "max_completion_tokens" not in b
    assert b["user"] == "u1" and b["messages"] == MSG
    # Sampling resolved once and pinned identically for both legs (defaults made explicit).
    assert (b["temperature"], b["top_p"], b["top_k"], b["seed"], b["ignore_eos"]) == \
        (1.0, 1.0, 0, None, False)
    nexrt = b["kv_transfer_params"]["nexrt"]
    assert set(nexrt) == {"rid", "generation", "control_addr", "node_url"}
    assert nexrt["node_url"] == stack.node_urls[0] and nexrt["generation"] >= 1


def test_stop_string_cuts_and_cancels_node(stack):
    body = {"prompt": "stop test prompt"}
    text, _ = expected(stack, body, 20)
    words = text.split(" ")
    stop = " " + words[4]             # cut before the 4th word
    cut = text[:text.index(stop)]
    node = stack.nodes[0]
    node.token_delay, gen = 0.02, len(node.generated)
    r = client(stack).completions.create(model="tiny", prompt=body["prompt"], max_tokens=20,
                                         stop=[stop], temperature=0)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client(stack).completions.create(model="tiny", prompt=body["prompt"],
                                                   max_tokens=20, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    node.token_delay = 0.0
    assert stack.idle()
    # Decoding was cut short at the stop string (never run to max_tokens) and the node is free.
    assert len(node.generated) == gen and node.rid is None


def test_stop_token_ids_eos_and_ignore_eos(stack):
    body = {"prompt": "eos test"}
    _, toks = expected(stack, body, 10)
    c = client(stack)
    # A client stop id: text stops before it, the id is counted, finish "stop".
    r = c.completions.create(model="tiny", prompt=body["prompt"], max_tokens=10,
                             extra_body={"stop_token_ids": [toks[3]]})
    text3, _ = expected(stack, body, 3)
    assert r.choices[0].text == text3 and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 4
    # EOS from the node.
    stack.model.eos_at = 5
    r = c.completions.create(model="tiny", prompt=body["prompt"], max_tokens=10)
    text5, _ = expected(stack, body, 5)
    assert r.choices[0].text == text5 and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 6
    # ignore_eos reaches both legs: full length.
    r = c.completions.create(model="tiny", prompt=body["prompt"], max_tokens=10,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    assert stack.vllm.requests[-1]["ignore_eos"] is True
    # EOS as vLLM's first token: no decode at all, empty text, node reservation cancelled.
    stack.model.eos_at = 0
    gen = len(stack.nodes[0].generated)
    r = c.completions.create(model="tiny", prompt=body["prompt"], max_tokens=10)
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 1 and len(stack.nodes[0].generated) == gen


def test_max_tokens_one_needs_no_decode(stack):
    body = {"prompt": "one"}
    text, _ = expected(stack, body, 1)
    gen = len(stack.nodes[0].generated)
    r = client(stack).completions.create(model="tiny", prompt="one", max_tokens=1)
    assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 1 and len(stack.nodes[0].generated) == gen
