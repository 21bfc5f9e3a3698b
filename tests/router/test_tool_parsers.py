"""Router tool-call parsing (hermes, qwen3_coder) gives what vLLM's own parsers give on the same text.

Every recorded text is checked three ways against vLLM 0.32 driven as its chat serving drives it:
non-streaming (reasoning, content, tool_calls), streaming one token per delta (each delta's JSON,
tool-call ids aside), and streaming cut at every character position and char by char.
"""
import json
import subprocess
import sys

import pytest

from nexrt_vllm.router.chat_parser import ChatOptions
from nexrt_vllm.router.tool_parsers import get_tool_parser
from nexrt_vllm.testing.vllm_parsers import Pair, hermes_call, parser_tokenizer, per_token_deltas, qwen3_coder_call

PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
        "metric": {"type": "boolean"}, "note": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        "unit": {"enum": ["c", "f"]}, "count": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
TOOLS = [WEATHER, SEARCH]


QWEN3_CODER = {
    "plain": "Hello! How can I help you today?",
    "think_then_call": "<think>\nNeed the weather.\n</think>\n\n" + qwen3_coder_call("get_weather", city="Paris", days=3),
    "think_opened_in_prompt": "Need the weather.\n</think>\n\nChecking.\n" + qwen3_coder_call("get_weather", city="Paris"),
    "schema_types": qwen3_coder_call("get_weather", city='San Francisco, "CA"', days=7, temp=-2.5, metric="true",
                         note="null", tags='["a", "b"]', where='{"lat": 48.85}', unit="c", count=12,
                         extra="not in the schema"),
    "schema_types_unparsable": qwen3_coder_call("get_weather", city=123, days="three", temp="inf", metric="yes",
                                    where="{not json", count="many"),
    "two_calls_with_content": "I'll check both.\n" + qwen3_coder_call("get_weather", city="Paris") + "\n"
                              + qwen3_coder_call("search", query="best café in Zürich 😀"),
    "multiline_value": qwen3_coder_call("search", query="line one\nline two: a > b and c < d\n"),
    "escapes_unicode": qwen3_coder_call("search", query='He said "hi" in C:\\dir\\file — ünïcödé 東京\ttab'),
    "content_after_call": qwen3_coder_call("search", query="x") + "\nDone, waiting for results.",
    "function_without_tool_call": "<function=search>\n<parameter=query>\nx\n</parameter>\n</function>",
    "missing_function_end": "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</tool_call>",
    "truncated_in_value": "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
    "truncated_in_name": "Let me look.\n<tool_call>\n<function=get_wea",
    "opener_only": "Let me call a tool <tool_call>",
    "no_function_in_call": "<tool_call>\nnot a function call\n</tool_call> after",
    "no_params": "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
    "unclosed_param": "<tool_call>\n<function=search>\n<parameter=query>\nx\n<parameter=page>\n2\n</function>\n</tool_call>",
    "json_body_in_xml_parser": hermes_call("search", {"query": "x"}),
    "call_without_think_end": "<think>\nI need data\n" + qwen3_coder_call("search", query="q"),
    "markup_in_reasoning": "<think>\nMaybe <function=search> helps, or <parameter=x>?\n</think>\nNo tool needed.",
    "double_think_end": "<think>a</think>b</think>c",
    "special_token_in_text": "Hello<|endoftext|> world",
    "whitespace_before_call": "\n\n" + qwen3_coder_call("search", query="x"),
    "angles_in_content": "if a<b and c>d then <tool_ maybe",
}

HERMES = {
    "plain": "Just text with < and > signs.",
    "call": hermes_call("get_weather", {"city": "Paris", "days": 3}),
    "think_then_call": "<think>\nweather\n</think>\n\n" + hermes_call("get_weather", {"city": "Paris"}),
    "two_calls_with_content": "Sure!\n" + hermes_call("get_weather", {"city": "Paris"}) + "\n"
                              + hermes_call("search", {"query": 'café "q" \\ 東京 😀'}),
    "ascii_escapes": '<tool_call>\n{"name": "search", "arguments": {"query": "caf\\u00e9 \\"x\\""}}\n</tool_call>',
    "nested_args": hermes_call("get_weather", {"city": "Paris", "where": {"lat": 48.85, "tags": [1, 2]}}),
    "bad_json": '<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call>',
    "no_arguments": '<tool_call>\n{"name": "search"}\n</tool_call>',
    "name_not_string": '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>',
    "arguments_as_string": '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": 1}"}\n</tool_call>',
    "truncated": '<tool_call>\n{"name": "search", "arguments": {"query": "par',
    "unclosed_but_complete": '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}',
    "content_after_call": hermes_call("search", {"query": "x"}) + "\nDone.",
    "partial_opener_at_end": "Text that ends with <tool_",
    "empty_call": "<tool_call></tool_call>",
}

COMBOS = [("qwen3", "qwen3_coder", QWEN3_CODER), (None, "qwen3_coder", QWEN3_CODER),
          ("qwen3", "hermes", HERMES), (None, "hermes", HERMES)]
CASES = [pytest.param(r, t, text, id=f"{r}-{t}-{name}")
         for r, t, texts in COMBOS for name, text in texts.items()]

# Request variants, each on a few texts: tool_choice none with tools, no tools at all, forced
# choices (vLLM parses them as auto behind a grammar), hidden reasoning, thinking off.
VARIANTS = {
    "choice_none": ChatOptions(tools=TOOLS, tool_choice="none"),
    "no_tools": ChatOptions(),
    "required": ChatOptions(tools=TOOLS, tool_choice="required"),
    "named": ChatOptions(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}}),
    "hide_reasoning": ChatOptions(tools=TOOLS, include_reasoning=False),
    "thinking_off": ChatOptions(tools=TOOLS, thinking=False),
}
VARIANT_TEXTS = ["plain", "think_then_call", "two_calls_with_content", "content_after_call"]
VARIANT_CASES = [pytest.param(v, r, t, texts[name], id=f"{v}-{r}-{t}-{name}")
                 for v in VARIANTS for r, t, texts in COMBOS for name in VARIANT_TEXTS]


@pytest.fixture(scope="module")
def tok():
    return parser_tokenizer()


@pytest.fixture(scope="module")
def prompt_ids(tok):
    return tok.encode(PROMPT, add_special_tokens=False)


def _check(tok, prompt_ids, opts, r, t, text, splits=True):
    pair = Pair(tok, opts, r, t)
    mine, ref = pair.parse(text)
    assert mine == ref, "non-streaming"
    pair.assert_token_stream_same(text, prompt_ids)
    if splits:
        pair.assert_split_streams_same(text, prompt_ids)


@pytest.mark.parametrize("r,t,text", CASES)
def test_same_as_vllm(tok, prompt_ids, r, t, text):
    _check(tok, prompt_ids, ChatOptions(tools=TOOLS), r, t, text)


@pytest.mark.parametrize("variant,r,t,text", VARIANT_CASES)
def test_same_as_vllm_request_variants(tok, prompt_ids, variant, r, t, text):
    _check(tok, prompt_ids, VARIANTS[variant], r, t, text, splits=False)


def test_special_marker_tokens_same_as_vllm(prompt_ids):
    """A tokenizer that marks <think>/<tool_call> special (vLLM then keeps them in the text)."""
    tok = parser_tokenizer(markers_special=True)
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    for r, t, texts in COMBOS:
        for name in ("think_then_call", "two_calls_with_content", "special_token_in_text"):
            if name in texts:
                _check(tok, prompt, ChatOptions(tools=TOOLS), r, t, texts[name], splits=False)


def test_qwen3_coder_values_typed_from_schema():
    content, calls = get_tool_parser("qwen3_coder")(TOOLS).extract(QWEN3_CODER["schema_types"])
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "city": 'San Francisco, "CA"', "days": 7, "temp": -2.5, "metric": True, "note": None,
        "tags": ["a", "b"], "where": {"lat": 48.85}, "unit": "c", "count": 12,
        "extra": "not in the schema"}
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"


def test_qwen3_coder_unparsable_values_stay_strings():
    _, calls = get_tool_parser("qwen3_coder")(TOOLS).extract(QWEN3_CODER["schema_types_unparsable"])
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "city": "123", "days": "three", "temp": "inf", "metric": "yes", "where": "{not json",
        "count": "many"}


def test_hermes_malformed_call_returns_whole_text_as_content():
    for name in ("bad_json", "no_arguments", "name_not_string", "empty_call"):
        content, calls = get_tool_parser("hermes")(TOOLS).extract(HERMES[name])
        assert (content, calls) == (HERMES[name], []), name


def test_streamed_arguments_accumulate_to_the_final_json(tok, prompt_ids):
    """Clients concatenate argument fragments per index; the result is the non-streaming JSON."""
    text = QWEN3_CODER["two_calls_with_content"]
    parser = Pair(tok, ChatOptions(tools=TOOLS), "qwen3", "qwen3_coder").router()
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    for d, _ in per_token_deltas(tok, prompt_ids, text):
        out = parser.feed(d, prompt_ids=prompt_ids, token_count=1) or {}
        for tc in out.get("tool_calls", []):
            names.setdefault(tc["index"], tc.get("function", {}).get("name"))
            args[tc["index"]] = args.get(tc["index"], "") + tc.get("function", {}).get("arguments", "")
    out = parser.feed("", finished=True) or {}
    for tc in out.get("tool_calls", []):
        args[tc["index"]] = args.get(tc["index"], "") + tc.get("function", {}).get("arguments", "")
    assert names == {0: "get_weather", 1: "search"}
    assert json.loads(args[0]) == {"city": "Paris"}
    assert json.loads(args[1]) == {"query": "best café in Zürich 😀"}
    assert parser.tools_streamed


def test_unknown_parser_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown tool-call parser 'qwen4'.*hermes.*qwen3_coder"):
        get_tool_parser("qwen4")


def test_parsers_import_neither_torch_nor_vllm():
    code = ("import sys; import nexrt_vllm.router.chat_parser; "
            "bad = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; "
            "print('LOADED', bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
