"""The Qwen3 / Qwen3.5 markup: `<think>` reasoning and `<tool_call><function=…><parameter=…>` calls
(vllm/parser/qwen3.py)."""
from __future__ import annotations

import json
import re
from typing import Callable

from .engine import Ev, Grammar, State, Transition


QWEN3_TERMINALS = {
    "THINK_START": "<think>", "THINK_END": "</think>",
    "TOOL_START": "<tool_call>", "TOOL_END": "</tool_call>",
    "FUNC_PREFIX": "<function=", "FUNC_END": "</function>",
    "PARAM_START": "<parameter=", "PARAM_END": "</parameter>", "CLOSE_ANGLE": ">",
}
# Markers vLLM also matches by token id; and the ChatML turn boundaries its prompt check stops at.
QWEN3_TOKEN_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
CHATML_TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")

_PARAM_RE = re.compile(
    r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))", re.DOTALL)
_PARTIAL_PARAM_RE = re.compile(r"<\s*parameter\s*=\s*([^>]+)>(.*)$", re.DOTALL)


def _trim_newlines(value: str) -> str:
    """One leading and one trailing newline are template markup, not part of the value."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def qwen3_arg_converter(raw: str, partial: bool) -> str:
    """`<parameter=k>v</parameter>…` → JSON object text (string values; typing comes later)."""
    params: dict[str, object] = {}
    for m in _PARAM_RE.finditer(raw):
        params[m.group(1)] = _trim_newlines(m.group(2))
    if partial:
        m = _PARTIAL_PARAM_RE.search(_PARAM_RE.sub("", raw))
        if m and m.group(1):
            params[m.group(1)] = _trim_newlines(m.group(2))
    return json.dumps(params, ensure_ascii=False)


def qwen3_grammar(thinking: bool = True) -> Grammar:
    return _QWEN3[bool(thinking)]


def _qwen3(thinking: bool) -> Grammar:
    S, E, T = State, Ev, Transition
    return Grammar(
        name="qwen3",
        terminals=QWEN3_TERMINALS,
        initial_state=S.REASONING if thinking else S.CONTENT,
        wait_for_reasoning=thinking,
        transitions={
            (S.REASONING, "THINK_START"): T(S.REASONING),
            (S.REASONING, "THINK_END"): T(S.CONTENT, (E.REASONING_END,)),
            (S.CONTENT, "THINK_END"): T(S.CONTENT),  # a repeated </think> is dropped
            (S.REASONING, "TOOL_START"): T(S.TOOL_PREAMBLE, (E.REASONING_END, E.TOOL_START)),
            (S.CONTENT, "TOOL_START"): T(S.TOOL_PREAMBLE, (E.REASONING_END, E.TOOL_START)),
            (S.CONTENT, "FUNC_PREFIX"): T(S.TOOL_NAME, (E.TOOL_START,)),  # <function= without <tool_call>
            (S.TOOL_PREAMBLE, "TOOL_END"): T(S.CONTENT, (E.TOOL_END,)),
            (S.TOOL_PREAMBLE, "FUNC_PREFIX"): T(S.TOOL_NAME),
            (S.TOOL_NAME, "CLOSE_ANGLE"): T(S.TOOL_ARGS),
            (S.TOOL_NAME, "FUNC_END"): T(S.TOOL_BETWEEN, (E.TOOL_END,)),
            (S.TOOL_ARGS, "FUNC_END"): T(S.TOOL_BETWEEN, (E.TOOL_END,)),
            (S.TOOL_ARGS, "PARAM_START"): T(S.TOOL_ARGS, (E.ARG,)),
            (S.TOOL_ARGS, "PARAM_END"): T(S.TOOL_ARGS, (E.ARG,)),
            (S.TOOL_BETWEEN, "TOOL_END"): T(S.CONTENT),
            (S.TOOL_BETWEEN, "TOOL_START"): T(S.TOOL_PREAMBLE, (E.TOOL_START,)),
            (S.TOOL_BETWEEN, "FUNC_PREFIX"): T(S.TOOL_NAME, (E.TOOL_START,)),
        },
        arg_converter=qwen3_arg_converter,
        strip_trailing_reasoning_whitespace=False,
    )


_QWEN3 = {True: _qwen3(True), False: _qwen3(False)}


def qwen3_prompt_reasoning_ended(prompt_ids: list[int], token_id: Callable[[str], int | None],
                                 thinking: bool = True) -> bool:
    """Whether reasoning is already closed where the prompt ends (vLLM `is_reasoning_end`).

    Scans back from the end: a `</think>` or `<tool_call>` token → closed; a `<think>` → open
    (when thinking); a ChatML turn boundary → open iff thinking is on.
    """
    end_think, tool_start = token_id("</think>"), token_id("<tool_call>")
    # vLLM derives the end ids from the grammar; without a `</think>` token it finds none.
    end_ids = set() if end_think is None else {end_think} | ({tool_start} - {None})
    start = token_id("<think>")
    boundaries = {i for i in map(token_id, CHATML_TURN_BOUNDARIES) if i is not None}
    for tid in reversed(prompt_ids):
        if tid in end_ids:
            return True
        if start is not None and tid == start:
            if thinking:
                return False
            break
        if tid in boundaries:
            break
    return not thinking
