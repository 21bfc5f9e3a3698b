"""One chat request's output → `reasoning`, `content`, `tool_calls`: vLLM's composed parser.

vLLM serves `--reasoning-parser` and `--tool-call-parser` through one `DelegatingParser` per
request: reasoning is split off first, then the tool parser sees only the content (streaming: the
tool parser starts on the text after the end of reasoning). This is that composition, so the router
answers what vLLM alone answers for the same text. `parse()` is the non-streaming path, `feed()`
the streaming one; deltas are dicts with exactly the keys vLLM's `DeltaMessage` sets (a key may be
present with `None`, which vLLM serializes as `null`).

`tool_choice` "required" and named functions are parsed like "auto", as vLLM does when it
constrains those calls with a structural tag (its default); the constraining itself is not here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .reasoning import get_reasoning_parser
from .tool_parsers import get_tool_parser


@dataclass(frozen=True)
class ChatOptions:
    """The request fields the parsers read."""

    tools: list[dict] | None = None
    tool_choice: Any = None  # None → vLLM's default: "auto" with tools, else "none"
    include_reasoning: bool = True
    thinking: bool = True  # chat_template_kwargs.enable_thinking

    @classmethod
    def from_request(cls, body: dict, default_chat_template_kwargs: dict | None = None) -> "ChatOptions":
        """From a chat request body and vLLM's `--default-chat-template-kwargs`.

        `enable_thinking`: the request's `chat_template_kwargs`, else `reasoning_effort != "none"`
        when given, else the server default, else on; a null or "auto" in the request defers to
        the server default (vLLM's merge), and vLLM reads the value by truthiness.
        """
        kwargs = dict(body.get("chat_template_kwargs") or {})
        effort = body.get("reasoning_effort")
        if effort is not None and "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = effort != "none"
        if default_chat_template_kwargs:
            kwargs = dict(default_chat_template_kwargs) | {
                k: v for k, v in kwargs.items() if v is not None and v != "auto"}
        return cls(tools=body.get("tools") or None, tool_choice=body.get("tool_choice"),
                   include_reasoning=bool(body.get("include_reasoning", True)),
                   thinking=bool(kwargs.get("enable_thinking", True)))

    @property
    def effective_tool_choice(self) -> Any:
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice


class ChatParser:
    """Parsers for one request. `tool_parser` set means vLLM's `--enable-auto-tool-choice` too."""

    def __init__(self, options: ChatOptions, *, reasoning_parser: str | None = None,
                 tool_parser: str | None = None, drop_tokens: tuple[str, ...] = (),
                 token_id: Callable[[str], int | None] | None = None):
        """`drop_tokens`: the tokenizer's special tokens; `token_id`: text → id of one token or None."""
        self.opts = options
        self.tool_choice = options.effective_tool_choice
        self.reasoning = (get_reasoning_parser(reasoning_parser)(
            thinking=options.thinking, drop_tokens=drop_tokens, token_id=token_id)
            if reasoning_parser else None)
        self.tools = (get_tool_parser(tool_parser)(options.tools, drop_tokens=drop_tokens)
                      if tool_parser else None)
        if self.reasoning is None and self.tools is not None and hasattr(self.tools, "skip_reasoning_parsing"):
            self.tools.skip_reasoning_parsing = True
        self.engine_based = self.tools is None or self.tools.engine_based
        self._prompt_checked = False
        self._reasoning_ended = False
        self._tool_text_started = False
        self._previous_text = ""
        self.tools_streamed = False

    @property
    def skip_special_tokens(self) -> bool:
        """How vLLM detokenizes for this request: parsers need marker tokens in the text."""
        if self.reasoning is not None:
            return False
        return self.tools is None or self.tool_choice == "none" or not self.opts.tools

    # ── non-streaming ──

    def parse(self, text: str) -> tuple[str | None, str | None, list[dict] | None]:
        """(reasoning, content, tool_calls); tool_calls `{"id", "name", "arguments"}`, `[]` or None."""
        if self.reasoning is None:
            reasoning, content = None, text
        else:
            reasoning, content = self.reasoning.split(text)
        calls, content = self._extract_calls(content)
        if not self.opts.include_reasoning:
            reasoning = None
        return reasoning, content, calls

    def _extract_calls(self, content: str | None) -> tuple[list[dict] | None, str | None]:
        if self.tools is None:
            return [], content
        choice = self.tool_choice
        if choice == "none":
            if self.engine_based:
                return [], self.tools.extract_info(content or "", choice)[2]
            return [], content
        forced = choice == "required" or isinstance(choice, dict)
        called, calls, parsed = self.tools.extract_info(content or "", choice)
        if called:
            return calls, (None if parsed and parsed.strip() == "" else parsed)
        if forced and (content is None or not content.strip()):
            return [], None
        if self.engine_based:
            return None, parsed or None
        return None, content

    # ── streaming ──

    def feed(self, delta_text: str, *, finished: bool = False, token_count: int = 0,
             prompt_ids: list[int] | None = None) -> dict | None:
        """One output delta (its text after stop strings) → the delta to send, or None for none."""
        if not self._prompt_checked and prompt_ids is not None:
            self._prompt_checked = True
            if self.reasoning is None or self.reasoning.prompt_reasoning_ended(prompt_ids):
                self._reasoning_ended = True
        current = delta_text if self.engine_based else self._previous_text + delta_text
        delta: dict | None = None
        transitioned = False

        if self.reasoning is not None and not self._reasoning_ended:
            delta = self.reasoning.stream(delta_text, token_count)
            if self.reasoning.ended:
                self._reasoning_ended = transitioned = True
                flush = self.reasoning.finish()
                # Text after the end marker (and what the lexer held) starts the content phase.
                current = (((delta or {}).get("content") or "")
                           + ((flush or {}).get("content") or ""))
                if self.engine_based:
                    if self.tools is None and current:
                        delta = delta if delta is not None else {}
                        delta["content"] = current
                else:
                    delta_text = current

        in_tools = self.tools is not None and self._reasoning_ended
        if in_tools:
            if not self._tool_text_started:
                self._tool_text_started = True
                self._previous_text = ""
                delta_text = current
            reasoning_now = (delta or {}).get("reasoning")
            delta = self._stream_calls(current, delta_text, token_count)
            if reasoning_now:
                if delta is None:
                    delta = {"reasoning": reasoning_now}
                elif not delta.get("reasoning"):
                    delta["reasoning"] = reasoning_now

        in_reasoning = self.reasoning is not None and not self._reasoning_ended
        if delta is None and not transitioned and not in_reasoning and not in_tools:
            delta = {"content": delta_text}
        self._previous_text = "" if self.engine_based else current

        if finished:
            delta = self._finish(delta)
        if delta is not None and not self.opts.include_reasoning:
            delta["reasoning"] = None
            if not delta.get("content") and not delta.get("tool_calls"):
                delta = None
        if delta is not None and delta.get("tool_calls"):
            self.tools_streamed = True
        return canonical(delta) if delta is not None else None

    def _stream_calls(self, current: str, delta_text: str, token_count: int) -> dict | None:
        choice = self.tool_choice
        if choice == "none" and not self.engine_based:
            return {"content": delta_text} if delta_text else None
        d = self.tools.stream(delta_text if self.engine_based else current, choice, token_count)
        if choice == "none" and d is not None:
            d.pop("tool_calls", None)
        return d

    def _finish(self, delta: dict | None) -> dict | None:
        if self.tools is not None and delta and delta.get("tool_calls"):
            fn = delta["tool_calls"][-1].get("function")
            if fn is not None:
                fn["arguments"] = (fn.get("arguments") or "") + self.tools.remaining_unstreamed_args()
        parsers = []
        if self.reasoning is not None and not self._reasoning_ended:
            parsers.append(self.reasoning)
        if self.tools is not None and self.tools.engine_based:
            parsers.append(self.tools)
        for p in parsers:
            flush = p.finish()
            if flush is None:
                continue
            if delta is None:
                delta = flush
                continue
            for key in ("content", "reasoning"):
                if flush.get(key):
                    delta[key] = (delta.get(key) or "") + flush[key]
            if flush.get("tool_calls"):
                delta["tool_calls"] = (delta.get("tool_calls") or []) + flush["tool_calls"]
        return delta

    def count_reasoning_tokens(self, token_ids: list[int], token_texts: list[str]) -> int:
        """usage `completion_tokens_details.reasoning_tokens` (vLLM reports it with a reasoning parser)."""
        if self.reasoning is None:
            return 0
        return self.reasoning.count_tokens(token_ids, token_texts)


_DELTA_KEYS = ("role", "content", "reasoning", "tool_calls")
_CALL_KEYS = ("id", "type", "index", "function")


def canonical(delta: dict) -> dict:
    """Key order of vLLM's models (its JSON is compared byte for byte); empty tool_calls dropped."""
    out = {k: delta[k] for k in _DELTA_KEYS if k in delta}
    if "tool_calls" in out:
        if not out["tool_calls"]:
            del out["tool_calls"]
        else:
            out["tool_calls"] = [
                {k: (_fn(tc[k]) if k == "function" and tc[k] is not None else tc[k])
                 for k in _CALL_KEYS if k in tc} for tc in out["tool_calls"]]
    return out


def _fn(fn: dict) -> dict:
    return {k: fn[k] for k in ("name", "arguments") if k in fn}
