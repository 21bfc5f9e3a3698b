"""Tool calls and reasoning through the router (`--tool-call-parser`, `--reasoning-parser`).

The fake node's model emits a scripted continuation (tool-call markup, a `<think>` block); the
router's answer, streaming and not, must equal what vLLM's own parsers (driven as vLLM's chat
serving drives them, nexrt_vllm/testing/vllm_parsers.py) give on the same tokens.
"""
import json

import openai
import pytest
import requests

from nexrt_vllm.router.chat_parser import ChatOptions
from nexrt_vllm.router.server import build_parser
from nexrt_vllm.testing.router_fakes import Stack
from nexrt_vllm.testing.vllm_parsers import (VllmChat, hermes_call, normalize_ids, parser_tokenizer, per_token_deltas,
                                             qwen3_coder_call)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast", "parameters": {
        "type": "object", "required": ["city"],
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
TOOLS = [WEATHER, SEARCH]


TEXTS = {
    "qwen3_coder": {
        "think_then_call": "<think>\nNeed the weather.\n</think>\n\n" + qwen3_coder_call("get_weather", city="Paris", days=3),
        "two_calls": "<think>\nBoth.\n</think>\n\nI'll check both.\n" + qwen3_coder_call("get_weather", city="Paris")
                     + "\n" + qwen3_coder_call("search", query='café "q" 東京 😀'),
        "think_then_text": "<think>\nNo tool needed.\n</think>\n\nIt is sunny in Paris.",
        "unclosed_think": "<think>\nStill thinking about the weather",
    },
    "hermes": {
        "think_then_call": "<think>\nweather\n</think>\n\n" + hermes_call("get_weather", {"city": "Paris", "days": 3}),
        "two_calls": "<think>\nBoth.\n</think>\n\nSure!\n" + hermes_call("get_weather", {"city": "Paris"})
                     + "\n" + hermes_call("search", {"query": 'café "q" \\ 東京'}),
        "think_then_text": "<think>\nNo tool needed.\n</think>\n\nIt is sunny in Paris.",
        "bad_json": "<think>\nx\n</think>\n\n" + '<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call>',
    },
}
CASES = [pytest.param(p, name, id=f"{p}-{name}") for p in TEXTS for name in TEXTS[p]]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("parser_tok"))
    parser_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tok():
    return parser_tokenizer()


@pytest.fixture(scope="module")
def stacks(tok_dir):
    made = {p: Stack(tok_dir, router_args=("--default-class", "interactive", "--reasoning-parser",
                                           "qwen3", "--tool-call-parser", p,
                                           "--enable-auto-tool-choice"))
            for p in TEXTS}
    yield made
    for s in made.values():
        s.close()


def _script(stack, tok, text):
    """The fake model's output: the text's tokens, then EOS; returns (ids, prompt ids)."""
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    stack.model.script = ids
    return ids, stack.model.prompt_ids({"messages": MESSAGES})


def _body(**extra):
    return {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, **extra}


def _vllm(tok, body, tool_parser):
    return VllmChat(tok, ChatOptions.from_request(body), reasoning_parser="qwen3",
                    tool_parser=tool_parser)


def _sse(url, body):
    """Every chunk of a streamed chat answer, as sent."""
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=30) as r:
        assert r.status_code == 200, r.text
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == b"data: [DONE]"
    return [json.loads(ln[len(b"data: "):]) for ln in lines[:-1]]


@pytest.mark.parametrize("parser,name", CASES)
def test_non_streaming_equals_vllm(stacks, tok, parser, name):
    stack, text = stacks[parser], TEXTS[parser][name]
    ids, _ = _script(stack, tok, text)
    body = _body()
    ref = _vllm(tok, body, parser)
    reasoning, content, calls = ref.parse(text)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(**body)
    msg = r.choices[0].message
    assert msg.content == content
    assert msg.model_extra.get("reasoning") == reasoning
    got = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    assert got == (calls or [])
    for c in msg.tool_calls or []:
        assert c.type == "function" and c.id.startswith("chatcmpl-tool-")
    assert r.choices[0].finish_reason == ("tool_calls" if calls else "stop")
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.completion_tokens_details.reasoning_tokens == ref.count_after_parse(text, ids)


@pytest.mark.parametrize("parser,name", CASES)
def test_streaming_equals_vllm(stacks, tok, parser, name):
    stack, text = stacks[parser], TEXTS[parser][name]
    ids, prompt_ids = _script(stack, tok, text)
    body = _body(stream=True, stream_options={"include_usage": True})
    # vLLM streams one delta per token; the EOS last, with no text.
    deltas = per_token_deltas(tok, prompt_ids, text) + [("", [ids[-1]])]
    ref_deltas, ref_count = _vllm(tok, body, parser).stream(deltas, prompt_ids)
    chunks = _sse(stack.url, body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    fin, usage = chunks[-2]["choices"][0], chunks[-1]["usage"]
    body_deltas = [c["choices"][0]["delta"] for c in chunks[1:-2]]
    assert [json.loads(normalize_ids(json.dumps(d))) for d in body_deltas] == \
        [json.loads(d) for d in ref_deltas if d is not None]
    streamed = any(d.get("tool_calls") for d in body_deltas)
    assert fin["finish_reason"] == ("tool_calls" if streamed else "stop") and fin["delta"] == {}
    assert usage["completion_tokens_details"] == {"reasoning_tokens": ref_count}
    # The openai client reassembles the same calls as the non-streaming answer.
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0)
    args: dict[int, list] = {}
    reasoning = ""
    for ch in client.chat.completions.create(**body):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning") or ""
        for tc in d.tool_calls or []:
            slot = args.setdefault(tc.index, ["", ""])
            slot[0] += (tc.function.name or "") if tc.function else ""
            slot[1] += (tc.function.arguments or "") if tc.function else ""
    ref_reasoning, _, ref_calls = _vllm(tok, _body(), parser).parse(text)
    assert reasoning == (ref_reasoning or "")
    if ref_calls:  # (vLLM streams what it can of a malformed call, then drops it unstreamed)
        assert [tuple(args[i]) for i in sorted(args)] == ref_calls


def test_truncated_by_max_tokens_streams_as_vllm(stacks, tok):
    parser = "qwen3_coder"
    stack, text = stacks[parser], TEXTS[parser]["think_then_call"]
    ids, prompt_ids = _script(stack, tok, text)
    n = len(ids) - 6          # ends inside the call
    body = _body(stream=True, max_tokens=n)
    deltas = per_token_deltas(tok, prompt_ids, text)[:n]
    ref_deltas, _ = _vllm(tok, body, parser).stream(deltas, prompt_ids)
    chunks = _sse(stack.url, body)
    got = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert [json.loads(normalize_ids(json.dumps(d))) for d in got] == \
        [json.loads(d) for d in ref_deltas if d is not None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    r = requests.post(f"{stack.url}/v1/chat/completions", json=_body(max_tokens=n), timeout=30).json()
    reasoning, content, calls = _vllm(tok, _body(), parser).parse(tok.decode(ids[:n]))
    m = r["choices"][0]["message"]
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])]
    assert (m["reasoning"], m["content"], got) == (reasoning, content, calls or [])
    # vLLM: a parsed call makes it "tool_calls" even when max_tokens ended the output
    assert r["choices"][0]["finish_reason"] == ("tool_calls" if calls else "length")


def test_thinking_off_and_tool_choice_none(stacks, tok):
    parser = "hermes"
    stack, text = stacks[parser], TEXTS[parser]["think_then_call"]
    _script(stack, tok, text)
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"tool_choice": "none"},
                  {"include_reasoning": False}):
        body = _body(**extra)
        reasoning, content, calls = _vllm(tok, body, parser).parse(text)
        r = requests.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30).json()
        m = r["choices"][0]["message"]
        got = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])]
        assert (m["reasoning"], m["content"], got) == (reasoning, content, calls or []), extra
    # the request's fields reach vLLM's prefill leg unchanged (it renders the template)
    sent = stack.vllm.requests[-1]
    assert sent["tools"] == TOOLS and sent["include_reasoning"] is False


def test_first_token_eos(stacks, tok):
    stack = stacks["qwen3_coder"]
    """vLLM's first token is EOS: the parser still gets its finishing (empty) feed."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    _, prompt_ids = _script(stack, tok, "")
    ref = _vllm(tok, _body(), "qwen3_coder")
    reasoning, content, _ = ref.parse("")
    r = requests.post(f"{stack.url}/v1/chat/completions", json=_body(), timeout=30).json()
    m = r["choices"][0]["message"]
    assert (m["reasoning"], m["content"], r["choices"][0]["finish_reason"]) == (reasoning, content, "stop")
    assert r["usage"]["completion_tokens"] == 1
    ref_deltas, _ = ref.stream([("", [eos])], prompt_ids)
    chunks = _sse(stack.url, _body(stream=True))
    assert [c["choices"][0]["delta"] for c in chunks[1:-1]] == [json.loads(d) for d in ref_deltas if d]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


F = {"type": "function", "function": {"name": "search"}}
REFUSALS = [
    (_body(tools=[]), 400, "`tools` must not be an empty array"),
    ({"model": "tiny", "messages": MESSAGES, "tool_choice": "auto"}, 400,
     "When using `tool_choice`, `tools` must be set."),
    (_body(tool_choice="required"), 400, "constrained decoding"),
    (_body(tool_choice=F), 400, "constrained decoding"),
    (_body(tools=[{"type": "function", "function": {**SEARCH["function"], "strict": True}}]), 400,
     "constrained decoding"),
    (_body(parallel_tool_calls=False), 400, "constrained decoding"),
    # these routers run --reasoning-parser: vLLM would apply the grammar after the reasoning only
    (_body(response_format={"type": "json_object"}), 400, "together with a reasoning parser"),
    (_body(logprobs=True, top_logprobs=21), 400, "at most 20 logprobs"),
]


@pytest.fixture(scope="module")
def strict(tok_dir):
    """The hermes router with --fallback error: the tier's own refusals (with the default
    `standard`, vLLM serves what the tier does not: tests/router/test_degrade_unsupported.py)."""
    s = Stack(tok_dir, router_args=("--default-class", "interactive", "--reasoning-parser", "qwen3",
                                    "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                                    "--fallback", "error"))
    yield s
    s.close()


@pytest.mark.parametrize("body,status,needle", REFUSALS)
def test_refusals(strict, body, status, needle):
    stack = strict
    admits = stack.nodes[0].admits
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**body)
    assert e.value.status_code == status and needle in e.value.message
    assert stack.nodes[0].admits == admits


def test_parallel_true_and_choice_none_accepted(stacks, tok):
    stack = stacks["hermes"]
    text = "<think>\n</think>\n\nHi."
    _script(stack, tok, text)
    for extra in ({"parallel_tool_calls": True}, {"tool_choice": "none", "parallel_tool_calls": False}):
        body = _body(**extra)
        r = requests.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == _vllm(tok, body, "hermes").parse(text)[1]


def test_flags_checked_at_startup():
    base = ["--vllm-url", "http://x", "--decode-url", "http://y"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--tool-call-parser", "nope"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--reasoning-parser", "nope"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--default-chat-template-kwargs", "[1]"])
    from nexrt_vllm.router.server import make_app
    with pytest.raises(SystemExit, match="requires --tool-call-parser"):
        make_app(build_parser().parse_args(base + ["--enable-auto-tool-choice"]))


def test_default_chat_template_kwargs(tok_dir, tok):
    """--default-chat-template-kwargs sets enable_thinking unless the request says otherwise."""
    stack = Stack(tok_dir, router_args=("--default-class", "interactive", "--reasoning-parser", "qwen3",
                                        "--default-chat-template-kwargs", '{"enable_thinking": false}'))
    try:
        text = TEXTS["hermes"]["think_then_text"]
        _script(stack, tok, text)
        for extra, thinking in (({}, False), ({"chat_template_kwargs": {"enable_thinking": True}}, True)):
            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 100, **extra}
            r = requests.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30).json()
            ref = VllmChat(tok, ChatOptions(thinking=thinking), reasoning_parser="qwen3", tool_parser=None)
            reasoning, content, _ = ref.parse(text)
            m = r["choices"][0]["message"]
            assert (m["reasoning"], m["content"]) == (reasoning, content), extra
            assert (reasoning is not None) == thinking
        # no tool parser: tools with "auto" go to the standard path (vLLM parses them there)
        r = requests.post(f"{stack.url}/v1/chat/completions", json=_body(), timeout=30)
        assert r.status_code == 200 and r.headers["x-nexrt-degraded"] == "tool_parser"
    finally:
        stack.close()
