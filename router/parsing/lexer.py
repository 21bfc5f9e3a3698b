"""Incremental lexer: text → terminals, holding back a suffix that may still become one
(vLLM `IncrementalLexer`, literal terminals only)."""
from __future__ import annotations

from dataclasses import dataclass

CONTENT_TERMINAL = "__CONTENT__"


@dataclass(slots=True)
class LexToken:
    terminal: str
    value: str
    token_count: int = 0


class Lexer:
    """Text → terminals. A buffer that may still grow into a terminal is held (vLLM IncrementalLexer)."""

    def __init__(self, literals: dict[str, str]):  # literal text -> terminal name
        self._literals = list(literals.items())
        self._first = frozenset(lit[0] for lit in literals if lit)
        self._prefixes = frozenset(lit[:i] for lit in literals for i in range(1, len(lit)))
        self._by_first: dict[str, list[tuple[str, str]]] = {}
        for lit, name in self._literals:
            self._by_first.setdefault(lit[0], []).append((lit, name))
        self.buffer = ""
        self._counts: list[int] = []

    def reset(self) -> None:
        self.buffer = ""
        self._counts = []

    def may_hold(self, text: str) -> bool:
        return bool(self.buffer) or not self._first.isdisjoint(text)

    def feed(self, text: str, token_count: int = 0) -> list[LexToken]:
        counts = [0] * len(text)
        if text and token_count:
            counts[0] = token_count
        if not self.buffer and self._first.isdisjoint(text):
            return [LexToken(CONTENT_TERMINAL, text, sum(counts))]
        self.buffer += text
        self._counts.extend(counts)
        return self._drain()

    def flush(self) -> list[LexToken]:
        tokens = self._drain(final=True) if self.buffer else []
        if self.buffer:
            tokens.append(LexToken(CONTENT_TERMINAL, self.buffer, sum(self._counts)))
            self.buffer, self._counts = "", []
        return tokens

    def _pop(self, n: int) -> int:
        c = sum(self._counts[:n])
        del self._counts[:n]
        return c

    def _drain(self, final: bool = False) -> list[LexToken]:
        tokens: list[LexToken] = []
        while self.buffer:
            buf = self.buffer
            if self._first.isdisjoint(buf):
                tokens.append(LexToken(CONTENT_TERMINAL, buf, sum(self._counts)))
                self.buffer, self._counts = "", []
                break
            best: tuple[str, str] | None = None
            for lit, name in self._by_first.get(buf[0], ()):
                if buf.startswith(lit) and (best is None or len(lit) > len(best[1])):
                    best = (name, lit)
            # A complete literal that is also the prefix of a longer one waits for the next chunk.
            if buf in self._prefixes and not final:
                if best is None:
                    break
                if any(len(lit) > len(best[1]) and lit.startswith(buf)
                       for lit, _ in self._by_first.get(buf[0], ())):
                    break
            if best is not None:
                tokens.append(LexToken(best[0], best[1], self._pop(len(best[1]))))
                self.buffer = buf[len(best[1]):]
                continue
            end = self._content_boundary(buf)
            tokens.append(LexToken(CONTENT_TERMINAL, buf[:end], self._pop(end)))
            self.buffer = buf[end:]
        return tokens

    def _content_boundary(self, buf: str) -> int:
        n = len(buf)
        for i in range(1, n):
            if buf[i] not in self._first:
                continue
            rest = n - i
            for lit, _ in self._literals:
                k = min(rest, len(lit))
                if buf[i:i + k] == lit[:k]:
                    return i
        return n
