"""States, events, grammars, and the state machine that turns terminals into events
(vLLM `StreamingParserEngine`, text path)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

from .lexer import CONTENT_TERMINAL, Lexer, LexToken


class State(enum.Enum):
    CONTENT = enum.auto()
    REASONING = enum.auto()
    TOOL_PREAMBLE = enum.auto()
    TOOL_NAME = enum.auto()
    TOOL_ARGS = enum.auto()
    TOOL_BETWEEN = enum.auto()


TOOL_STATES = frozenset({State.TOOL_PREAMBLE, State.TOOL_NAME, State.TOOL_ARGS, State.TOOL_BETWEEN})
_PLAIN_STATES = frozenset({State.CONTENT, State.REASONING})


class Ev(enum.Enum):
    TEXT = enum.auto()
    REASONING_START = enum.auto()
    REASONING = enum.auto()
    REASONING_END = enum.auto()
    TOOL_START = enum.auto()
    TOOL_NAME = enum.auto()
    ARG = enum.auto()
    TOOL_END = enum.auto()


_REASONING_EVENTS = frozenset({Ev.REASONING_START, Ev.REASONING_END})
DROP = "__DROP__"


@dataclass(slots=True)
class Event:
    type: Ev
    value: str = ""
    tool_index: int = -1
    token_count: int = 0


@dataclass(frozen=True, slots=True)
class Transition:
    next_state: State
    events: tuple[Ev, ...] = ()


@dataclass(frozen=True)
class Grammar:
    """A model's markup: terminals, transitions, and how tool-call bodies become JSON arguments."""

    name: str
    terminals: dict[str, str]
    transitions: dict[tuple[State, str], Transition]
    initial_state: State = State.CONTENT
    wait_for_reasoning: bool = False
    arg_converter: Callable[[str, bool], str] | None = None
    # The rest are vLLM ParserEngineConfig fields at the values the ported grammars use.
    content_events: dict[State, Ev] = field(default_factory=lambda: {
        State.CONTENT: Ev.TEXT, State.REASONING: Ev.REASONING,
        State.TOOL_NAME: Ev.TOOL_NAME, State.TOOL_ARGS: Ev.ARG})
    strip_trailing_reasoning_whitespace: bool = True
    drop_whitespace_only_content_before_tools: bool = True
    strip_content_whitespace_with_tools: bool = True


class StreamingEngine:
    """Text deltas → semantic events (vLLM StreamingParserEngine, text path)."""

    def __init__(self, grammar: Grammar, drop_tokens: tuple[str, ...] = ()):
        self.g = grammar
        configured = set(grammar.terminals.values())
        drops = {t for t in drop_tokens if t not in configured}
        literals = {lit: name for name, lit in grammar.terminals.items()}
        for t in drops:
            literals[t] = DROP
        self._has_drops = bool(drops)
        self._lexer = Lexer(literals)
        tr = grammar.transitions
        self._tool_terminals = frozenset(
            t for (s, t), x in tr.items() if x.next_state in TOOL_STATES or s in TOOL_STATES)
        self._tool_exit_terminals = frozenset(
            t for (s, t), x in tr.items() if s in TOOL_STATES and x.next_state not in TOOL_STATES)
        self._reasoning_markup = self._reasoning_markup_terminals()
        self.skip_tool_parsing = False
        self.skip_reasoning_parsing = False
        self.reset()

    def _reasoning_markup_terminals(self) -> frozenset[str]:
        tr = self.g.transitions
        markers = frozenset(t for (s, t), x in tr.items()
                            if State.REASONING in (s, x.next_state) and x.next_state not in TOOL_STATES)
        for (s, t), x in tr.items():
            if t in markers and (s not in _PLAIN_STATES or x.next_state not in _PLAIN_STATES
                                 or not _REASONING_EVENTS.issuperset(x.events)):
                return frozenset()
        return markers

    def reset(self, initial_state: State | None = None) -> None:
        self.state = initial_state if initial_state is not None else self.g.initial_state
        self.tool_index = -1
        self.reasoning_token_count = 0
        self._lexer.reset()
        self._in_skipped_tool_span = False

    def _count(self, events: list[Event]) -> list[Event]:
        self.reasoning_token_count += sum(e.token_count for e in events if e.type == Ev.REASONING)
        return events

    def feed(self, text: str, token_count: int = 0) -> list[Event]:
        if not text:
            return []
        if not self._lexer.may_hold(text):
            return self._count(self._emit(text, token_count))
        return self._count(self._process(self._lexer.feed(text, token_count)))

    def finish(self) -> list[Event]:
        events = self._process(self._lexer.flush())
        if self.state in TOOL_STATES:
            if self.tool_index >= 0:
                events.append(Event(Ev.TOOL_END, tool_index=self.tool_index))
            self.state = State.CONTENT
        elif self.state == State.REASONING:
            events.append(Event(Ev.REASONING_END, tool_index=self.tool_index))
            self.state = State.CONTENT
        return self._count(events)

    def _process(self, tokens: list[LexToken]) -> list[Event]:
        events: list[Event] = []
        for tok in tokens:
            if tok.terminal == CONTENT_TERMINAL:
                if tok.value:
                    events.extend(self._emit(tok.value, tok.token_count))
            else:
                events.extend(self._on_terminal(tok.terminal, tok.value, tok.token_count))
        return events

    def _emit(self, text: str, token_count: int = 0) -> list[Event]:
        kind = self.g.content_events.get(self.state)
        if kind is None:  # e.g. text between <tool_call> and <function=: discarded, as in vLLM
            return []
        return [Event(kind, text, self.tool_index, token_count)]

    def _on_terminal(self, terminal: str, value: str, token_count: int) -> list[Event]:
        tr = self.g.transitions.get((self.state, terminal))
        if tr is None:
            if self._has_drops and terminal == DROP:
                return []
            if self.skip_tool_parsing and terminal in self._tool_exit_terminals:
                self._in_skipped_tool_span = False
            return self._emit(value, token_count)
        if self.skip_reasoning_parsing and terminal in self._reasoning_markup:
            return self._emit(value, token_count)
        if self.skip_tool_parsing and terminal in self._tool_terminals:
            is_opener = tr.next_state in TOOL_STATES
            is_exit = terminal in self._tool_exit_terminals
            if not (is_exit and not is_opener and not self._in_skipped_tool_span):
                if is_opener:
                    self._in_skipped_tool_span = True
                elif is_exit:
                    self._in_skipped_tool_span = False
                # A tool opener that implicitly ends reasoning still ends it in the reasoning pass.
                if Ev.REASONING_END in tr.events:
                    self.state = State.CONTENT
                    return [Event(Ev.REASONING_END, value, self.tool_index),
                            Event(Ev.TEXT, value, self.tool_index)]
                kind = self.g.content_events.get(self.state)
                return [Event(kind, value, self.tool_index)] if kind is not None else []
        return self._apply(tr, value, token_count)

    def _apply(self, tr: Transition, value: str, token_count: int) -> list[Event]:
        events: list[Event] = []
        self.state = tr.next_state
        for kind in tr.events:
            if kind == Ev.TOOL_START:
                self.tool_index += 1
            if kind == Ev.TEXT and not value:
                continue
            events.append(Event(kind, value, self.tool_index, token_count))
        return events
