"""Reasoning parsers: `<think>…</think>` → the `reasoning` field, as vLLM's `--reasoning-parser`.

`qwen3` (vLLM `Qwen3ParserReasoningAdapter`) serves Qwen3 and Qwen3.5, with or without the opening
`<think>` in the output (Qwen3.5's template puts it in the prompt): with thinking on, the output
*starts* in reasoning; `</think>` — or a `<tool_call>`, which ends reasoning implicitly — switches
to content; a stream that never closes it is all reasoning. With thinking off
(`chat_template_kwargs.enable_thinking: false`) everything is content. Tool markup inside the
reasoning span is reasoning text; after it, it is left in the content for the tool parser.
"""
from __future__ import annotations

from typing import Callable

from .parsing.deltas import EngineParser
from .parsing.qwen3 import QWEN3_TOKEN_MARKERS, qwen3_grammar, qwen3_prompt_reasoning_ended


class Qwen3ReasoningParser:
    def __init__(self, *, thinking: bool = True, drop_tokens: tuple[str, ...] = (),
                 token_id: Callable[[str], int | None] | None = None):
        """`drop_tokens`: the tokenizer's special tokens (vLLM drops them from parsed text);
        `token_id`: text → id of a single token, or None (the prompt check and counts use ids)."""
        self.thinking = thinking
        self._drop = drop_tokens
        self._token_id = token_id or (lambda _s: None)
        self._p = EngineParser(qwen3_grammar(thinking), drop_tokens=drop_tokens)
        self._p.engine.skip_tool_parsing = True
        self._streamed = False

    def split(self, text: str) -> tuple[str | None, str | None]:
        """Non-streaming: (reasoning, content), None for an empty part."""
        self._streamed = False
        if not self.thinking:
            return None, text
        return self._p.split_reasoning(text)

    def stream(self, delta_text: str, token_count: int = 0) -> dict | None:
        """Streaming: a delta with `reasoning` and/or `content`, or None while text is held back."""
        self._streamed = True
        self._p.initialize_streaming()
        return self._p.feed(delta_text, token_count)

    @property
    def ended(self) -> bool:
        """The stream has passed the end of reasoning."""
        return self._p.reasoning_ended

    def finish(self) -> dict | None:
        """End of the stream: what was held back."""
        return self._p.finish_streaming()

    def prompt_reasoning_ended(self, prompt_ids: list[int]) -> bool:
        return qwen3_prompt_reasoning_ended(prompt_ids, self._token_id, self.thinking)

    def count_tokens(self, token_ids: list[int], token_texts: list[str]) -> int:
        """Reasoning tokens among the output tokens (usage `completion_tokens_details`).

        vLLM counts two ways. After a stream: the tokens fed while in reasoning that brought text
        (a token completing a multi-byte character counts, the ones before it do not). Otherwise
        it re-scans by token id: every token before the first `</think>` / `<tool_call>` token,
        markers and special tokens excepted.
        """
        if self._streamed:
            return self._p.engine.reasoning_token_count
        if not self.thinking:
            return 0
        tid = self._token_id
        end_think = tid("</think>")
        if end_think is None:  # no marker tokens: only the text can say where reasoning ends
            counter = EngineParser(qwen3_grammar(self.thinking), drop_tokens=self._drop)
            for text in token_texts:
                counter.engine.feed(text, 1)
            counter.engine.finish()
            return counter.engine.reasoning_token_count
        ends = {end_think, tid("<tool_call>")}
        anchors = {i for i in map(tid, QWEN3_TOKEN_MARKERS + tuple(self._drop)) if i is not None}
        n = 0
        for t in token_ids:
            if t in ends:
                break
            n += t not in anchors
        return n


REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {"qwen3": Qwen3ReasoningParser}


def get_reasoning_parser(name: str) -> type[Qwen3ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {sorted(REASONING_PARSERS)}") from None
