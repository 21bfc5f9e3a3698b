"""When the router's tool / reasoning parser flags fall short of what client requests need, the
log says so once, not per request (test doubles of vLLM and the nodes)."""
import logging

import pytest
import requests

from nexrt_vllm.testing.router_fakes import Stack, tokenizer_dir

MESSAGES = [{"role": "user", "content": "hi"}]
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tokenizer_dir(tmp_path_factory), router_args=("--default-class", "interactive"))
    yield s
    s.close()


def warnings_naming(caplog, flag):
    return [r for r in caplog.records
            if r.name == "nexrt.router" and r.levelno >= logging.WARNING and flag in r.getMessage()]


def test_tools_without_tool_parser_flags_logged_once(stack, caplog):
    caplog.set_level(logging.INFO, logger="nexrt.router")
    for _ in range(3):
        r = requests.post(f"{stack.url}/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 3, "tools": [SEARCH]})
        assert r.status_code == 200 and r.headers["x-nexrt-degraded"] == "tool_parser"
    said = warnings_naming(caplog, "--enable-auto-tool-choice --tool-call-parser")
    assert len(said) == 1, [r.getMessage() for r in said]


def test_reasoning_without_reasoning_parser_logged_once(stack, caplog):
    caplog.set_level(logging.INFO, logger="nexrt.router")
    for extra in ({"chat_template_kwargs": {"enable_thinking": True}}, {"reasoning_effort": "high"},
                  {"include_reasoning": True}):
        r = requests.post(f"{stack.url}/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 3, **extra})
        assert r.status_code == 200 and "x-nexrt-degraded" not in r.headers   # served by the tier
    said = warnings_naming(caplog, "--reasoning-parser")
    assert len(said) == 1, [r.getMessage() for r in said]
