"""Events → OpenAI deltas and extracted calls for one request (vLLM ParserEngine)."""
from __future__ import annotations

import json
import re
import secrets

from .arguments import fix_arg_types, safe_arg_prefix, streamable_string_keys, tool_properties
from .engine import Ev, Event, Grammar, State, StreamingEngine


def make_tool_call_id() -> str:
    """vLLM's id format: `chatcmpl-tool-` + 16 hex digits."""
    return f"chatcmpl-tool-{secrets.randbits(64):016x}"


class _Slot:
    __slots__ = ("id", "name", "args", "name_sent", "string_keys", "streamed_json")

    def __init__(self) -> None:
        self.id = ""
        self.name = ""
        self.args = ""
        self.name_sent = False
        self.string_keys: set[str] | None = None
        self.streamed_json = ""


_NAME_RE = re.compile(r'"name"\s*:\s*"([^"]*)"')


class EngineParser:
    """One grammar, one request: deltas shaped like vLLM's `DeltaMessage.model_dump(exclude_unset=True)`.

    Delta dicts hold `content`, `reasoning` and `tool_calls` (each `{"index", "id"?, "type"?,
    "function": {"name"?, "arguments"?}}`), only the keys vLLM sets.
    """

    def __init__(self, grammar: Grammar, tools: list[dict] | None = None, *,
                 drop_tokens: tuple[str, ...] = ()):
        self.g = grammar
        self.tools = tools
        self.engine = StreamingEngine(grammar, drop_tokens)
        self.has_reasoning = ("THINK_END" in grammar.terminals or "THINK_START" in grammar.terminals
                              or grammar.initial_state == State.REASONING)
        self._streaming_initialized = False
        self.suppress_tool_calls = False
        self._reset()

    def _reset(self, initial_state: State | None = None) -> None:
        self.engine.reset(initial_state)
        self.reasoning_ended = not self.has_reasoning
        self.slots: list[_Slot] = []
        self._deferred_content = ""
        self._deferred_reasoning = ""
        self._content_has_nonws = False

    def initialize_streaming(self, initial_state: State | None = None) -> None:
        if not self._streaming_initialized:
            self._streaming_initialized = True
            self._reset(initial_state)

    def check_request(self, tools: list[dict] | None, tool_choice: Any) -> None:
        if tools:
            self.tools = tools
        if not self.engine.skip_tool_parsing and not self.suppress_tool_calls:
            if tool_choice == "none" and tools:
                self.suppress_tool_calls = True

    def feed(self, text: str, token_count: int = 0) -> dict | None:
        return self._strip_trailing_reasoning(self.to_delta(self.engine.feed(text, token_count)))

    def finish_streaming(self) -> dict | None:
        events = self.engine.finish()
        if events or self._deferred_content:
            return self.to_delta(events, finished=True)
        return None

    def _strip_trailing_reasoning(self, delta: dict | None) -> dict | None:
        if not self.g.strip_trailing_reasoning_whitespace:
            return delta
        if delta is not None and delta.get("reasoning") is not None:
            combined = self._deferred_reasoning + delta["reasoning"]
            trimmed = combined.rstrip()
            self._deferred_reasoning = combined[len(trimmed):]
            delta["reasoning"] = trimmed or None
            if delta["reasoning"] is None and delta.get("content") is None and not delta.get("tool_calls"):
                return None
        elif self._deferred_reasoning and self.reasoning_ended:
            self._deferred_reasoning = ""
        return delta

    # non-streaming
    def single_pass(self, text: str, initial_state: State | None = None
                    ) -> tuple[str | None, str | None, list[dict]]:
        """(reasoning, content, tool_calls) of a whole text; tool_calls as `{"id", "name", "arguments"}`."""
        self._reset(initial_state)
        events = self.engine.feed(text) + self.engine.finish()
        delta = self.to_delta(events, finished=True)
        calls = self.extracted_calls()
        reasoning = delta.get("reasoning") if delta else None
        if reasoning and self.g.strip_trailing_reasoning_whitespace:
            reasoning = reasoning.rstrip() or None
        content = delta.get("content") if delta else None
        if content:
            content = self._strip_content_ws(content, bool(calls))
        return reasoning, content, calls

    def split_reasoning(self, text: str) -> tuple[str | None, str | None]:
        self._reset()
        reasoning, content = [], []
        for e in self.engine.feed(text) + self.engine.finish():
            if e.type == Ev.REASONING:
                reasoning.append(e.value)
            elif e.type == Ev.TEXT:
                content.append(e.value)
            elif e.type == Ev.REASONING_END:
                self.reasoning_ended = True
        r = "".join(reasoning)
        if self.g.strip_trailing_reasoning_whitespace:
            r = r.rstrip()
        return r or None, "".join(content) or None

    def _strip_content_ws(self, content: str, tools_called: bool) -> str | None:
        if tools_called:
            if self.g.strip_content_whitespace_with_tools:
                content = content.strip()
            elif self.g.drop_whitespace_only_content_before_tools and not content.strip():
                content = ""
        return content or None

    def to_delta(self, events: list[Event], finished: bool = False) -> dict | None:
        if not events and not self._deferred_content:
            return None
        calls: list[dict] = []
        content_parts: list[str] = []
        reasoning_parts: list[str] = []
        carried = self._deferred_content
        seen_tool = False
        for e in events:
            t = e.type
            if t == Ev.TEXT:
                if seen_tool:
                    self._deferred_content += e.value
                else:
                    content_parts.append(e.value)
            elif t == Ev.REASONING:
                reasoning_parts.append(e.value)
            elif t == Ev.REASONING_END:
                self.reasoning_ended = True
            elif self.suppress_tool_calls or t == Ev.REASONING_START:
                continue
            elif t == Ev.TOOL_START:
                seen_tool = True
                while len(self.slots) <= e.tool_index:
                    self.slots.append(_Slot())
            elif t == Ev.TOOL_NAME:
                seen_tool = True
                self.slots[e.tool_index].name += e.value
            elif t == Ev.ARG:
                seen_tool = True
                self._on_arg(e, calls)
            elif t == Ev.TOOL_END:
                seen_tool = True
                self._on_tool_end(e, calls)
        if len(calls) > 1:
            calls = _coalesce(calls)
        if self._deferred_content and (not seen_tool or not calls):
            now = self._deferred_content[len(carried):]
            if carried:
                content_parts.insert(0, carried)
            if now:
                content_parts.append(now)
            self._deferred_content = ""
        content = "".join(content_parts)
        if not self._content_has_nonws and content:
            if content.strip():
                self._content_has_nonws = True
            elif self.slots:
                if self.g.drop_whitespace_only_content_before_tools:
                    content = ""
            elif not finished:
                self._deferred_content = content
                content = ""
        reasoning = "".join(reasoning_parts)
        if not (content or calls or reasoning):
            return None
        out: dict = {}
        if content:
            out["content"] = content
        if reasoning:
            out["reasoning"] = reasoning
        if calls:
            out["tool_calls"] = calls
        return out

    def _ensure_id(self, slot: _Slot) -> None:
        if not slot.id:
            slot.id = make_tool_call_id()

    def _name_delta(self, idx: int, name: str | None, calls: list[dict]) -> None:
        if not name:
            return
        slot = self.slots[idx]
        slot.name, slot.name_sent = name, True
        slot.string_keys = streamable_string_keys(tool_properties(self.tools, name))
        self._ensure_id(slot)
        calls.append({"id": slot.id, "type": "function", "index": idx, "function": {"name": name}})

    def _on_arg(self, e: Event, calls: list[dict]) -> None:
        idx = e.tool_index
        slot = self.slots[idx]
        if e.value:
            slot.args += e.value
        if not slot.name_sent:
            if slot.name:
                self._name_delta(idx, slot.name, calls)
            elif e.value:
                self._name_delta(idx, self._name_from_args(idx), calls)
        elif e.value:
            diff = self._arg_delta(idx, e.value)
            if diff:
                calls.append({"index": idx, "function": {"arguments": diff}})

    def _on_tool_end(self, e: Event, calls: list[dict]) -> None:
        idx = e.tool_index
        if idx >= len(self.slots):
            return
        remaining = self._flush_args(idx)
        slot = self.slots[idx]
        if not slot.name_sent:
            name = slot.name or self._name_from_args(idx) or ""
            if name:
                slot.name, slot.name_sent = name, True
                slot.string_keys = streamable_string_keys(tool_properties(self.tools, name))
                self._ensure_id(slot)
                calls.append({"id": slot.id, "type": "function", "index": idx,
                              "function": {"name": name, "arguments": remaining or ""}})
                remaining = None
        if remaining and slot.name_sent:
            calls.append({"index": idx, "function": {"arguments": remaining}})

    def _converted_args(self, slot: _Slot, partial: bool) -> str | None:
        """The slot's arguments as JSON by the grammar's converter (``partial``: a body still
        growing); None when they do not convert."""
        try:
            return self.g.arg_converter(slot.args, partial)
        except (json.JSONDecodeError, ValueError, TypeError):
            return None

    def _arg_delta(self, idx: int, raw: str) -> str | None:
        if self.g.arg_converter is None:
            return raw
        slot = self.slots[idx]
        current = self._converted_args(slot, True)
        if not current:
            return None
        if slot.name:
            current = fix_arg_types(current, slot.name, self.tools)
        prev = slot.streamed_json
        safe = safe_arg_prefix(current, slot.string_keys)
        if not safe or safe == prev or (prev and not safe.startswith(prev)):
            return None
        diff = safe[len(prev):]
        if diff:
            slot.streamed_json = safe
            return diff
        return None

    def _flush_args(self, idx: int) -> str | None:
        if self.g.arg_converter is None:
            return None
        slot = self.slots[idx]
        final = self._converted_args(slot, False)
        if final:
            final = fix_arg_types(final, slot.name, self.tools)
        prev = slot.streamed_json
        if final and len(final) > len(prev):
            if prev and not final.startswith(prev):
                return None
            slot.streamed_json = final
            return final[len(prev):]
        return None

    def _name_from_args(self, idx: int) -> str | None:
        m = _NAME_RE.search(self.slots[idx].args)
        return m.group(1) or None if m else None

    def extracted_calls(self) -> list[dict]:
        calls = []
        for slot in self.slots:
            if not slot.name and not slot.args:
                continue
            name, body = slot.name.strip(), slot.args
            if not name and body.strip():
                name, args = _name_and_args(body)
            elif body.strip():
                conv = self.g.arg_converter
                try:
                    args = conv(body, False) if conv is not None else _args_json(body)
                except (json.JSONDecodeError, ValueError, TypeError):
                    args = _args_json(body)
            else:
                args = "{}"
            if name:
                self._ensure_id(slot)
                calls.append({"id": slot.id, "name": name,
                              "arguments": fix_arg_types(args, name, self.tools)})
        return calls


def _coalesce(calls: list[dict]) -> list[dict]:
    merged: dict[int, dict] = {}
    for tc in calls:
        ex = merged.get(tc["index"])
        if ex is None:
            merged[tc["index"]] = tc
            continue
        for key in ("id", "type"):
            if tc.get(key) is not None and ex.get(key) is None:
                ex[key] = tc[key]
        fn = tc.get("function")
        if fn is not None:
            if ex.get("function") is None:
                ex["function"] = fn
            else:
                efn = ex["function"]
                if fn.get("name") is not None and efn.get("name") is None:
                    efn["name"] = fn["name"]
                if fn.get("arguments") is not None:
                    efn["arguments"] = (efn["arguments"] + fn["arguments"]
                                        if efn.get("arguments") is not None else fn["arguments"])
    return calls if len(merged) == len(calls) else list(merged.values())


def _name_and_args(body: str) -> tuple[str, str]:
    body = body.strip()
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return "", body
    if not isinstance(parsed, dict):
        return "", body
    name = parsed.get("name", "")
    for key in ("arguments", "parameters"):
        if key in parsed:
            v = parsed[key]
            return name, v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    return name, json.dumps({k: v for k, v in parsed.items() if k != "name"}, ensure_ascii=False)


def _args_json(body: str) -> str:
    return "{}" if not body.strip() else _name_and_args(body)[1]
