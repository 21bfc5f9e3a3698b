"""Incremental detokenization and router-side stop strings.

Detokenization mirrors vLLM's fast incremental detokenizer (tokenizers' `DecodeStream`, special
tokens skipped), so the text equals what vLLM alone would stream for the same token ids. It is primed
with the prompt's last `PRIME_TOKENS` ids, not the whole prompt as vLLM does: a token's text depends
only on the few ids before it (an incomplete UTF-8 character spans at most 3 byte tokens), and
decoding an 8K-token prompt again would sit on the first token's path (milliseconds).

Stop strings are matched on the text with a hold-back of `max(len(stop)) - 1` characters: nothing
that could still become the start of a stop string is sent early, and the cut point depends only on
the full text, never on how tokens were chunked.
"""
from __future__ import annotations

import tokenizers
from tokenizers.decoders import DecodeStream


PRIME_TOKENS = 8


class Detokenizer:
    """Token id → text delta, one id at a time."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        """`skip_special_tokens=False`: output parsers need marker tokens in the text (as vLLM)."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=_priming(tokenizer, list(prompt_ids or ()), skip_special_tokens),
                                    skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tok, token_id) or ""
        except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception here
            # Same recovery as vLLM (#17448): a non-monotonic UTF-8 prefix breaks DecodeStream;
            # restart it without context rather than failing the whole stream.
            if "Invalid prefix" not in str(e):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            return self._stream.step(self._tok, token_id) or ""


def _priming(tok: tokenizers.Tokenizer, ids: list[int], skip: bool) -> list[int]:
    """The prompt tail that primes the stream as the whole prompt would: the last PRIME_TOKENS ids
    when they decode to whole characters, else (a prompt ending in a broken UTF-8 sequence, where
    DecodeStream's state reaches further back) the whole prompt."""
    tail = ids[-PRIME_TOKENS:]
    if len(tail) < len(ids) and "\ufffd" in tok.decode(tail, skip_special_tokens=skip):
        return ids
    return tail


class StopStrings:
    """Feeds text deltas; returns what may be sent now. `stopped` once a stop string completed."""

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buf = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped or not text:
            return ""
        self._buf += text
        if not self._stops:
            out, self._buf = self._buf, ""
            return out
        # The first stop string to *complete* wins (earliest end; on a tie the longer one, i.e.
        # the earlier start): a property of the text alone, hence independent of chunking.
        best = None
        for s in self._stops:
            i = self._buf.find(s)
            if i >= 0:
                key = (i + len(s), i)
                if best is None or key < best:
                    best = key
        if best is not None:
            out = self._buf[:best[1]]
            self._buf = ""
            self.stopped = True
            return out
        cut = max(0, len(self._buf) - self._hold)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out

    def flush(self) -> str:
        """End of generation without a stop match: release the held-back tail."""
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out
