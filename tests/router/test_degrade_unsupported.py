"""Requests the interactive tier does not serve but vLLM does (tools without the router's parser
flags, tool_choice "required" / a named function, strict tools, parallel_tool_calls false, tools on
completions, n > 1, batched prompts, ...) go to the standard path unchanged: vLLM's own answer
(status and body), `x-nexrt-degraded: <reason>`, `degraded_total{reason}` counted, no node
reserved. With `--fallback error` the tier's own 400 / 501 instead (test doubles of vLLM and the
nodes)."""
import json

import pytest
import requests

from nexrt_vllm.testing.router_fakes import Stack, tokenizer_dir

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "call a tool"}], "max_tokens": 5}
CMPL = {"model": "tiny", "prompt": "call a tool", "max_tokens": 5}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
STRICT = {"type": "function", "function": {**SEARCH["function"], "strict": True}}

TOOLS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
REASONING = ("--reasoning-parser", "qwen3")

# (path, body, router flags, reason, status with --fallback error)
CASES = [
    ("chat/completions", {**CHAT, "tools": [SEARCH]}, (), "tool_parser", 400),
    ("chat/completions", {**CHAT, "tools": [SEARCH], "tool_choice": "required"}, TOOLS,
     "tool_choice_required", 400),
    ("chat/completions", {**CHAT, "tools": [SEARCH], "tool_choice": {
        "type": "function", "function": {"name": "search"}}}, TOOLS, "tool_choice_named", 400),
    ("chat/completions", {**CHAT, "tools": [STRICT]}, TOOLS, "strict_tools", 400),
    ("chat/completions", {**CHAT, "tools": [SEARCH], "parallel_tool_calls": False}, TOOLS,
     "parallel_tool_calls", 400),
    ("completions", {**CMPL, "tools": [SEARCH]}, TOOLS, "completion_tools", 501),
    ("completions", {**CMPL, "tool_choice": "auto"}, (), "completion_tools", 501),
    ("completions", {**CMPL, "n": 2}, (), "request_option", 501),
    ("chat/completions", {**CHAT, "presence_penalty": 0.5}, (), "request_option", 501),
    ("completions", {**CMPL, "stream": True, "return_token_ids": True}, (), "request_option", 501),
    ("completions", {**CMPL, "seed": -1}, (), "request_option", 400),
    ("completions", {**CMPL, "prompt": ["a", "b"]}, (), "batched_prompt", 501),
    ("completions", {**CMPL, "logprobs": 21}, (), "logprobs", 400),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "number", "multipleOf": 2}}}}, (), "grammar", 400),
    ("completions", {**CMPL, "structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
     (), "grammar", 400),
    ("completions", {**CMPL, "guided_regex": "a+"}, (), "grammar", 400),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, REASONING,
     "reasoning_grammar", 400),
]
IDS = [f"{c[3]}-{i}" for i, c in enumerate(CASES)]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    """A router per (--fallback, parser flags), made on first use."""
    tok_dir = tokenizer_dir(tmp_path_factory)
    made = {}

    def get(policy, flags):
        if (policy, flags) not in made:
            made[policy, flags] = Stack(tok_dir, router_args=(
                "--default-class", "interactive", "--fallback", policy, *flags))
        return made[policy, flags]
    yield get
    for s in made.values():
        s.close()


def counter(s, name, reason):
    want = f'nexrt_router_{name}_total{{reason="{reason}"}} '
    for line in requests.get(s.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(want):
            return float(line.split()[1])
    raise AssertionError(f"{want} not exported")


def post(url, path, body):
    return requests.post(f"{url}/v1/{path}", data=json.dumps(body), timeout=30,
                         headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("path,body,flags,reason,strict_status", CASES, ids=IDS)
def test_standard_path_answers_what_the_tier_does_not_serve(stacks, path, body, flags, reason,
                                                              strict_status):
    s = stacks("standard", flags)
    admits, before = s.nodes[0].admits, counter(s, "degraded", reason)
    r = post(s.url, path, body)
    assert r.status_code == 200, r.text
    assert r.headers["x-nexrt-degraded"] == reason
    assert counter(s, "degraded", reason) == before + 1
    assert s.nodes[0].admits == admits                       # no node reserved
    seen = s.vllm.standard if body.get("stream") else s.vllm.requests
    assert seen[-1] == body                                  # the client's request, unchanged
    direct = post(s.vllm_url, path, body)                    # what vLLM alone answers
    if body.get("stream"):
        assert r.text.endswith("data: [DONE]\n\n") and r.text.count("data:") == direct.text.count("data:")
    else:
        got, ref = r.json(), direct.json()
        assert {k: v for k, v in got.items() if k != "created"} == \
               {k: v for k, v in ref.items() if k != "created"}


@pytest.mark.parametrize("path,body,flags,reason,strict_status", CASES, ids=IDS)
def test_fallback_error_keeps_the_tiers_refusal(stacks, path, body, flags, reason, strict_status):
    s = stacks("error", flags)
    admits, calls = s.nodes[0].admits, len(s.vllm.requests) + len(s.vllm.standard)
    failures = counter(s, "fast_path_failures", reason)
    r = post(s.url, path, body)
    assert r.status_code == strict_status, r.text
    err = r.json()["error"]
    assert err["code"] == strict_status and err["param"] and "x-nexrt-degraded" not in r.headers
    assert counter(s, "fast_path_failures", reason) == failures + 1
    assert counter(s, "degraded", reason) == 0
    assert s.nodes[0].admits == admits and len(s.vllm.requests) + len(s.vllm.standard) == calls


def test_invalid_requests_stay_400(stacks):
    """What vLLM refuses too is answered at once, whatever --fallback says."""
    s = stacks("standard", ())
    calls = len(s.vllm.requests) + len(s.vllm.standard)
    for path, body, needle in (
            ("chat/completions", {**CHAT, "tools": []}, "must not be an empty array"),
            ("chat/completions", {**CHAT, "tool_choice": "auto"}, "`tools` must be set"),
            ("chat/completions", {**CHAT, "tools": [SEARCH], "tool_choice": "sometimes"},
             "Invalid value for `tool_choice`"),
            ("completions", {**CMPL, "max_tokens": "5"}, "max_tokens"),
            ("chat/completions", {**CHAT, "response_format": {"type": "bogus"}}, "response_format")):
        r = post(s.url, path, body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        assert "x-nexrt-degraded" not in r.headers
    assert len(s.vllm.requests) + len(s.vllm.standard) == calls
