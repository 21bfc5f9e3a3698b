r"""Tool-call parsers: the model's continuation → OpenAI `tool_calls`, as vLLM's `--tool-call-parser`.

- `qwen3_coder` (alias `qwen3_xml`; vLLM `Qwen3EngineToolParser`), Qwen3.5 and Qwen3-Coder:
  `<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>`
- `hermes` (alias `qwen3_json`; vLLM `Hermes2ProToolParser`), Qwen2.5 and Qwen3:
  `<tool_call>\n{"name": NAME, "arguments": {…}}\n</tool_call>`

`qwen3_coder` values are strings typed from the tool's JSON schema (integer, number, boolean,
null, object, array; unparsable → string); argument JSON streams as soon as no later token can
rewrite it. `hermes` streams the raw `arguments` text and, non-streaming, returns the whole text as
content when any call is not valid JSON with a string `name` and an `arguments` key.

Each parser: `extract(text)` → `(content, tool_calls)` (vLLM's `extract_tool_calls`; calls as
`{"id", "type", "function": {"name", "arguments"}}`), and `stream(…)` / `finish()` returning delta
dicts (keys exactly those vLLM's `DeltaMessage` sets). The request-level composition with
reasoning and `tool_choice` is `chat_parser.ChatParser`.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .parsing.deltas import EngineParser, make_tool_call_id
from .parsing.engine import State
from .parsing.qwen3 import qwen3_grammar


class ToolParser:
    """`engine_based` parsers are fed only the new text; the others the whole text so far."""

    engine_based = False

    def __init__(self, tools: list[dict] | None = None, *, drop_tokens: tuple[str, ...] = ()):
        self.tools = tools

    def extract_info(self, text: str, tool_choice: Any = "auto") -> tuple[bool, list[dict], str | None]:
        """(tools_called, calls `{"id", "name", "arguments"}`, content)."""
        raise NotImplementedError

    def extract(self, text: str, tool_choice: Any = "auto") -> tuple[str | None, list[dict]]:
        called, calls, content = self.extract_info(text, tool_choice)
        return content, [{"id": c["id"], "type": "function",
                          "function": {"name": c["name"], "arguments": c["arguments"]}}
                         for c in calls]

    def remaining_unstreamed_args(self) -> str:
        return ""

    def finish(self) -> dict | None:
        return None


class Qwen3CoderToolParser(ToolParser):
    engine_based = True

    def __init__(self, tools: list[dict] | None = None, *, drop_tokens: tuple[str, ...] = ()):
        super().__init__(tools)
        self._p = EngineParser(qwen3_grammar(), tools, drop_tokens=drop_tokens)

    @property
    def skip_reasoning_parsing(self) -> bool:
        return self._p.engine.skip_reasoning_parsing

    @skip_reasoning_parsing.setter
    def skip_reasoning_parsing(self, value: bool) -> None:
        # Without a reasoning parser, <think>/</think> are plain content to the tool pass.
        self._p.engine.skip_reasoning_parsing = value

    def extract_info(self, text, tool_choice="auto"):
        # The text is reasoning-free content: parse from the content state.
        self._p.check_request(self.tools, tool_choice)
        _, content, calls = self._p.single_pass(text, initial_state=State.CONTENT)
        return bool(calls), calls, content

    def stream(self, delta_text: str, tool_choice: Any = "auto", token_count: int = 0) -> dict | None:
        self._p.initialize_streaming(State.CONTENT)
        self._p.check_request(self.tools, tool_choice)
        return self._p.feed(delta_text, token_count)

    def finish(self) -> dict | None:
        return self._p.finish_streaming()


def _partial_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that ends `text`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    _CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
    _NAME_RE = re.compile(r'"name"\s*:\s*"([^"]+)"')
    _ARGS_RE = re.compile(r'"arguments"\s*:\s*')

    def __init__(self, tools: list[dict] | None = None, *, drop_tokens: tuple[str, ...] = ()):
        super().__init__(tools)
        self._sent_content = 0
        self._prev: list[dict] = []
        self._streamed: list[str] = []

    def extract_info(self, text, tool_choice="auto"):
        if self.START not in text:
            return False, [], text
        try:
            calls = []
            for m in self._CALL_RE.findall(text):
                call = json.loads(m[0] if m[0] else m[1])
                name = call["name"]
                if not isinstance(name, str):
                    raise TypeError("tool call name is not a string")
                calls.append({"id": make_tool_call_id(), "name": name,
                              "arguments": json.dumps(call["arguments"], ensure_ascii=False)})
        except Exception:  # noqa: BLE001 - vLLM: any malformed call → the whole text is content
            return False, [], text
        content = text[:text.find(self.START)]
        return True, calls, content or None

    def _content(self, text: str) -> str | None:
        """Unsent text before the first <tool_call>, holding back a suffix that may start one."""
        if self.START not in text:
            sendable = len(text) - _partial_overlap(text, self.START)
        else:
            sendable = text.index(self.START)
        if sendable > self._sent_content:
            out = text[self._sent_content:sendable]
            self._sent_content = sendable
            return out
        return None

    def _bodies(self, text: str) -> list[tuple[str, bool]]:
        out, pos = [], 0
        while (start := text.find(self.START, pos)) != -1:
            body = start + len(self.START)
            end = text.find(self.END, body)
            if end != -1:
                out.append((text[body:end].strip(), True))
                pos = end + len(self.END)
                continue
            raw = text[body:]
            if (k := _partial_overlap(raw, self.END)):
                raw = raw[:-k]
            raw = raw.strip()
            out.append((raw, _is_json(raw) if raw else False))
            break
        return out

    def _args_diff(self, i: int, body: str, complete: bool) -> str | None:
        m = self._ARGS_RE.search(body)
        if not m:
            return None
        args = body[m.end():]
        if complete:
            args = args.rstrip()
            if args.endswith("}"):
                args = args[:-1].rstrip()
        if len(args) <= len(self._streamed[i]):
            return None
        diff = args[len(self._streamed[i]):]
        self._streamed[i] = args
        self._prev[i]["arguments"] = args
        return diff

    def stream(self, current_text: str, tool_choice: Any = "auto", token_count: int = 0) -> dict | None:
        """Re-parses the whole text so far; emits what was not sent yet."""
        try:
            content = self._content(current_text)
            calls: list[dict] = []
            for i, (body, complete) in enumerate(self._bodies(current_text)):
                if i >= len(self._prev):
                    self._prev.append({})
                    self._streamed.append("")
                if "name" not in self._prev[i]:
                    m = self._NAME_RE.search(body)
                    if not m:
                        break  # call i+1 cannot start before call i has a name
                    self._prev[i]["name"] = m.group(1)
                    calls.append({"id": make_tool_call_id(), "type": "function", "index": i,
                                  "function": {"name": m.group(1)}})
                diff = self._args_diff(i, body, complete)
                if diff:
                    calls.append({"index": i, "function": {"arguments": diff}})
            if content or calls:
                out: dict = {"content": content}
                if calls:
                    out["tool_calls"] = calls
                return out
            return None
        except Exception:  # noqa: BLE001 - vLLM drops the delta on a parse error
            return None

    def remaining_unstreamed_args(self) -> str:
        if not self._prev:
            return ""
        i = len(self._prev) - 1
        args = self._prev[i].get("arguments", {})
        expected = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        actual = self._streamed[i] if i < len(self._streamed) else ""
        return expected[len(actual):] if expected.startswith(actual) else ""


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_json": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(TOOL_PARSERS)}") from None
