"""Grammar-constrained decoding with xgrammar, set up as vLLM's xgrammar backend sets it up.

``Grammars(tokenizer_dir, vocab_size)`` builds xgrammar's tokenizer info from the checkpoint's
Hugging Face tokenizer (``TokenizerInfo.from_huggingface`` with the model's vocab size, as vLLM
does), so each step's allowed-token bitmask is the one vLLM computes for the same tokens.
``compile(spec)`` follows ``XgrammarBackend.compile_grammar``: JSON schemas with any whitespace
and strict mode, ``json_object`` as the schema ``{"type": "object"}``, a choice list as its EBNF
alternation, Lark or EBNF grammars, regexes. ``Constraint`` is one request's matcher, stopping on
the request's stop ids plus EOS, as vLLM's ``all_stop_token_ids``.

Bitmask: int32 words, bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed.
"""
from __future__ import annotations

import collections
import threading

import torch

from nexrt_vllm.handoff.structured import StructuredError, StructuredSpec

from nexrt_vllm.engine.errors import EngineError

CACHE = 64  # compiled grammars kept (vLLM relies on xgrammar's own cache the same way)


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_mask(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """logits [V] with every token whose bit is clear set to -inf (a new tensor)."""
    v = logits.shape[-1]
    t = torch.arange(v, device=logits.device)
    bits = (words.to(logits.device)[t // 32] >> (t % 32)) & 1
    return logits.masked_fill(bits == 0, float("-inf"))


class Grammars:
    """xgrammar compiler for one tokenizer; compiled grammars are cached by spec."""

    def __init__(self, tokenizer_dir: str | None, vocab_size: int, threads: int = 1, info=None):
        """`info`: an xgrammar TokenizerInfo to use instead of the tokenizer in `tokenizer_dir`."""
        import xgrammar as xgr

        self._xgr = xgr
        if info is None:
            from transformers import AutoTokenizer
            info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tokenizer_dir),
                                                      vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self.info = info
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredSpec):
        """The compiled grammar of `spec`; StructuredError names what is unsupported or malformed."""
        why = spec.unsupported()
        if why:
            raise StructuredError(why)
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return hit
        c = self.compiler
        try:
            if spec.type == "json_schema":
                import json
                g = c.compile_json_schema(json.dumps(spec.value), any_whitespace=True)
            elif spec.type == "json_object":
                g = c.compile_json_schema('{"type": "object"}', any_whitespace=True)
            elif spec.type == "choice":
                g = c.compile_grammar(spec.grammar_text())
            elif spec.type == "grammar":
                g = c.compile_lark(spec.value) if spec.is_lark else c.compile_grammar(spec.value)
            else:
                g = c.compile_regex(spec.value)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with the parser's text
            raise StructuredError(f"{spec.type} does not compile: {str(e).strip().splitlines()[0][:300]}") from None
        with self._lock:
            self._cache[spec.key] = g
            while len(self._cache) > CACHE:
                self._cache.popitem(last=False)
        return g

    def constraint(self, compiled, stop_token_ids) -> "Constraint":
        return Constraint(self._xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(set(stop_token_ids))),
                          self.vocab_size)


class Constraint:
    """One request's grammar state: accept each emitted token, fill the next step's bitmask."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.words = mask_words(vocab_size)
        self._row = torch.empty((1, self.words), dtype=torch.int32)

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(int(token)):
            raise EngineError(f"token {token} is not allowed by the grammar here")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The next token's bitmask into `out` (int32 [1, words], CPU; may be host-mapped memory)."""
        out = self._row if out is None else out
        self.matcher.fill_next_token_bitmask(out, 0)
        return out[0]


__all__ = ["Constraint", "Grammars", "apply_mask", "mask_words"]
