"""OpenAI logprobs as vLLM 0.32's chat and completions servers write them.

The first token's entry is vLLM's own (its prefill answer carries it, already formatted); the
node's tokens come as ``{"token", "logprob", "top_logprobs": [[id, lp], ...]}`` (most likely
first) and are formatted here the way vLLM formats a position of its sampled logprobs:

* a position is the ordered map {sampled id: lp, top-1 id: lp, ...} (vLLM inserts the sampled
  token first; a sampled token inside the top k keeps that first place);
* chat ``logprobs.content[]``: ``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``
  with ``top_logprobs`` the first k entries of that map; completions: ``tokens``,
  ``token_logprobs``, ``top_logprobs`` (the first k + 1 entries as {token string: lp}) and
  ``text_offset`` (running sum of the token strings' lengths, from 0);
* a token's string is vLLM's per-token detokenization: ``decode([id])`` keeping special tokens,
  the SentencePiece leading spaces that decode drops restored (Metaspace tokenizers), and a string
  ending in U+FFFD re-decoded with up to 4 preceding sampled tokens
  (``LogprobsProcessor._correct_decoded_token``); ``bytes`` its UTF-8 (errors replaced);
* ``-inf`` is sent as -9999.0 (the node already does so).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import tokenizers

FLOOR = -9999.0
_FFFD = "\ufffd"


def _leading_space_marker(tok: tokenizers.Tokenizer) -> str | None:
    """vLLM's get_leading_space_marker: the Metaspace replacement, if the pre-tokenizer has one."""
    try:
        pre = json.loads(tok.to_str()).get("pre_tokenizer") or {}
    except ValueError:
        return None
    subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for sub in subs:
        if isinstance(sub, dict) and sub.get("type") == "Metaspace":
            return sub.get("replacement", "\u2581")
    return None


# transformers' clean_up_tokenization (applied by decode when the tokenizer config asks for it)
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class TokenTexts:
    """Per-token strings as vLLM's logprobs carry them (see the module docstring)."""

    def __init__(self, tok: tokenizers.Tokenizer, clean_up_spaces: bool = False):
        self.tok, self.clean_up = tok, clean_up_spaces
        self.marker = _leading_space_marker(tok)
        self._cache: dict[int, str] = {}

    def decode(self, ids: list[int]) -> str:
        s = self.tok.decode(ids, skip_special_tokens=False)
        if self.clean_up:
            for a, b in _CLEANUP:
                s = s.replace(a, b)
        return s

    def plain(self, tid: int) -> str:
        """decode([id]) with the leading spaces restored (vLLM's convert_ids_list_to_tokens)."""
        s = self._cache.get(tid)
        if s is None:
            s = self.decode([tid])
            raw = self.tok.id_to_token(tid) if self.marker else None
            if raw:
                n = len(raw) - len(raw.lstrip(self.marker))
                missing = n - (len(s) - len(s.lstrip(" ")))
                if n and missing > 0:
                    s = " " * missing + s
            self._cache[tid] = s
        return s

    def text(self, tid: int, context: list[int]) -> str:
        """The string of `tid` after the sampled tokens `context` (oldest first)."""
        s = self.plain(tid)
        return self._correct(tid, context[-4:]) if s.endswith(_FFFD) else s

    def _correct(self, tid: int, context: list[int]) -> str:
        for n in range(1, len(context) + 1):
            ctx = context[-n:]
            full = self.decode(ctx + [tid])
            if full.endswith(_FFFD):
                continue
            clean_end = len(ctx)
            for j in range(len(ctx) - 1, -1, -1):
                if self.decode([ctx[j]]).endswith(_FFFD):
                    clean_end = j
                else:
                    break
            prefix = self.decode(ctx[:clean_end]) if clean_end > 0 else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0
            for a, b in zip(prefix, full):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


def _lp(v: float) -> float:
    return FLOOR if v != v else max(float(v), FLOOR)  # NaN too, as vLLM's OpenAI layer


def _utf8(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


@dataclass
class Logprobs:
    """One response's logprobs: entries added per token, rendered whole or in streamed slices."""

    texts: TokenTexts
    chat: bool
    k: int
    entries: list = field(default_factory=list)
    _sent: int = 0          # entries already streamed
    _offset: int = 0        # completions: text_offset of the next token
    _sampled: list[int] = field(default_factory=list)   # the sampled ids so far (decode context)

    def add_vllm_first(self, tid: int, lp: dict | None) -> None:
        """vLLM's first-token entry from its prefill answer (chat or completions form)."""
        if self.chat:
            content = (lp or {}).get("content") or []
            if not content:
                raise ValueError("vLLM's prefill answer has no logprobs.content")
            self.entries.append(content[0])
        else:
            if not lp or not lp.get("tokens"):
                raise ValueError("vLLM's prefill answer has no logprobs.tokens")
            self._completion(lp["tokens"][0], lp["token_logprobs"][0], lp["top_logprobs"][0])
        self._sampled.append(tid)

    def add_node(self, tid: int, line: dict) -> None:
        """A node token line (``logprob`` and ``top_logprobs`` [[id, lp], ...])."""
        ctx = self._sampled
        position = {tid: _lp(line["logprob"])}
        for i, v in line.get("top_logprobs") or ():
            position.setdefault(int(i), _lp(v))
        text = self.texts.text(tid, ctx)
        if self.chat:
            tops = []
            for i, v in list(position.items())[:self.k]:
                s = text if i == tid else self.texts.text(i, ctx)
                tops.append({"token": s, "logprob": v, "bytes": _utf8(s)})
            self.entries.append({"token": text, "logprob": position[tid], "bytes": _utf8(text), "top_logprobs": tops})
        else:
            top = {}
            for i, v in list(position.items())[:self.k + 1]:
                top[text if i == tid else self.texts.text(i, ctx)] = v
            self._completion(text, position[tid], top)
        self._sampled.append(tid)

    def _completion(self, token: str, lp, top) -> None:
        self.entries.append((self._offset, token, lp, top))
        self._offset += len(token)

    def render(self, entries: list) -> dict:
        if self.chat:
            return {"content": list(entries)}
        return {"text_offset": [e[0] for e in entries], "token_logprobs": [e[2] for e in entries],
                "tokens": [e[1] for e in entries], "top_logprobs": [e[3] for e in entries]}

    def whole(self) -> dict:
        return self.render(self.entries)

    def pending(self) -> dict | None:
        """The entries not streamed yet (None if there are none)."""
        if self._sent == len(self.entries):
            return None
        out, self._sent = self.render(self.entries[self._sent:]), len(self.entries)
        return out
