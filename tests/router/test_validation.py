"""Bad input on the interactive path → 4xx with an OpenAI error body, before any node is
reserved: malformed JSON, wrong types, negative/huge max_tokens, unknown model, what vLLM refuses
too. Fields the tier cannot honour get its 400/501 with `--fallback error` (with the default
`standard`, vLLM serves them: tests/router/test_degrade_unsupported.py)."""
import time

import pytest
import requests

from nexrt_vllm.testing.router_fakes import Stack, interactive_stack, tokenizer_dir


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from interactive_stack(tmp_path_factory)


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    s = Stack(tokenizer_dir(tmp_path_factory), router_args=("--default-class", "interactive",
                                                            "--fallback", "error"))
    yield s
    s.close()


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
CMPL = {"model": "tiny", "prompt": "hi"}

CASES = [
    ("completions", None, 400, "not valid JSON"),
    ("completions", [1, 2], 400, "JSON object"),
    ("chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("completions", {"model": "tiny"}, 400, "prompt"),
    ("completions", {**CMPL, "prompt": 5}, 400, "prompt"),
    ("completions", {**CMPL, "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {**CMPL, "max_tokens": 2.5}, 400, "max_tokens"),
    ("completions", {**CMPL, "max_tokens": True}, 400, "max_tokens"),
    ("completions", {**CMPL, "max_tokens": -3}, 400, "at least 1"),
    ("completions", {**CMPL, "max_tokens": 0}, 400, "at least 1"),
    ("completions", {**CMPL, "max_tokens": 10**9}, 400, "maximum context length"),
    ("chat/completions", {**CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("completions", {**CMPL, "temperature": "hot"}, 400, "temperature"),
    ("completions", {**CMPL, "temperature": -1}, 400, "temperature"),
    ("completions", {**CMPL, "top_p": 0}, 400, "top_p"),
    ("completions", {**CMPL, "top_k": -5}, 400, "top_k"),
    ("completions", {**CMPL, "seed": "x"}, 400, "seed"),
    ("completions", {**CMPL, "stream": "yes"}, 400, "stream"),
    ("completions", {**CMPL, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {**CMPL, "stop": 3}, 400, "stop"),
    ("completions", {**CMPL, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("completions", {**CMPL, "ignore_eos": "no"}, 400, "ignore_eos"),
    ("completions", {**CMPL, "model": 3}, 400, "model"),
    ("completions", {**CMPL, "model": "nope"}, 404, "does not exist"),
    # logprobs and structured output: vLLM's own 400s
    ("completions", {**CMPL, "logprobs": "2"}, 400, "`logprobs` must be an integer"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, 400, "`logprobs` must be set to true"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400, "'json_schema' field"),
    ("completions", {**CMPL, "structured_outputs": {"regex": "a+", "choice": ["a"]}}, 400, "exactly one of"),
    ("completions", {**CMPL, "structured_outputs": {"choice": []}}, 400, "non-empty list"),
]

# What vLLM serves but the tier does not: its answer with --fallback error.
TIER_CASES = [
    ("completions", {**CMPL, "seed": -1}, 400, "seed"),             # the node's range: [0, 2**63)
    ("completions", {**CMPL, "seed": 2**63}, 400, "seed"),
    ("completions", {**CMPL, "n": 2}, 501, "'n'"),
    ("completions", {**CMPL, "best_of": 3}, 501, "best_of"),
    ("completions", {**CMPL, "logprobs": 21}, 400, "at most 20 logprobs"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, 400, "at most 20 logprobs"),
    ("completions", {**CMPL, "prompt_logprobs": 1}, 501, "prompt_logprobs"),
    ("chat/completions", {**CHAT, "response_format": {"type": "structural_tag"}}, 400,
     "response_format type 'structural_tag' is not supported"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 2}}}}}},
     400, "multipleOf on a number is not supported (at $.properties.x)"),
    ("completions", {**CMPL, "structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}},
     400, "disable_any_whitespace"),
    ("completions", {**CMPL, "guided_regex": "a+"}, 400, "'guided_regex' is not supported"),
    ("completions", {**CMPL, "presence_penalty": 0.5}, 501, "presence_penalty"),
    ("completions", {**CMPL, "frequency_penalty": 0.5}, 501, "frequency_penalty"),
    ("completions", {**CMPL, "repetition_penalty": 1.2}, 501, "repetition_penalty"),
    ("completions", {**CMPL, "logit_bias": {"5": 10}}, 501, "logit_bias"),
    ("completions", {**CMPL, "min_p": 0.1}, 501, "min_p"),
    # Without --enable-auto-tool-choice: vLLM's own 400.
    ("chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "--enable-auto-tool-choice"),
    ("completions", {**CMPL, "prompt": ["a", "b"]}, 501, "batched prompts"),
    ("completions", {**CMPL, "echo": True}, 501, "echo"),
]


def _refused(stack, path, body, status, needle):
    admits = stack.nodes[0].admits
    data = b"{not json" if body is None else requests.models.complexjson.dumps(body)
    r = requests.post(f"{stack.url}/v1/{path}", data=data, timeout=10,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and err["type"]
    assert stack.nodes[0].admits == admits                 # nothing reserved
    assert stack.idle()


@pytest.mark.parametrize("path,body,status,needle", CASES)
def test_bad_request(stack, path, body, status, needle):
    _refused(stack, path, body, status, needle)


@pytest.mark.parametrize("path,body,status,needle", TIER_CASES)
def test_tier_refusal_with_fallback_error(strict, path, body, status, needle):
    _refused(strict, path, body, status, needle)


def test_bad_class_header(stack):
    r = requests.post(f"{stack.url}/v1/completions", json=CMPL, timeout=10,
                      headers={"X-NexRT-Class": "turbo"})
    assert r.status_code == 400 and "X-NexRT-Class" in r.json()["error"]["message"]


def test_over_context_after_prefill(stack):
    # The prompt length is known only after prefill: prompt + max_tokens over the node's limit
    # but within vLLM's → the standard path serves it (reason too_long), the node reservation is
    # released. (With --fallback error: 400, tests/router/test_fallback.py.)
    node = stack.nodes[0]
    node.max_seq_len = 8
    time.sleep(0.5)                  # the router reads /capabilities at its health checks
    try:
        r = requests.post(f"{stack.url}/v1/completions", timeout=10, json={
            **CMPL, "prompt": "a b c d e f", "max_tokens": 5, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.headers["x-nexrt-degraded"] == "too_long"
        m = stack.model
        assert r.json()["choices"][0]["token_ids"] == m.continuation(m.tok.encode("a b c d e f").ids, 5)
        assert r.json()["nexrt_timing"]["degraded"]["reason"] == "too_long"
    finally:
        node.max_seq_len = 4096
        time.sleep(0.5)
    assert stack.idle() and node.rid is None
