"""Sampling: greedy, temperature, top-k, top-p; seeded and reproducible through a torch.Generator.
Logprobs as vLLM's default ``raw_logprobs``: log-softmax of the fp32 logits the step produced (after
a grammar mask, before temperature and the top-k / top-p filters)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from nexrt_vllm.handoff.structured import LOGPROBS_MAX

from nexrt_vllm.engine.errors import SamplingParamsError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token and when to stop.

    temperature 0 is greedy (argmax, first index on ties). top_k 0 or -1 and top_p 1 disable those
    filters. EOS ends generation unless ignore_eos; a stop token id always does. Stop/EOS tokens are
    emitted. max_tokens bounds the tokens produced for the request. logprobs None: none returned;
    k in 0..20: each token's logprob and its k most likely alternatives.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default=())
    logprobs: int | None = None

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not is_num(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise SamplingParamsError(f"top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise SamplingParamsError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stops = self.stop_token_ids if self.stop_token_ids is not None else ()
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
            raise SamplingParamsError(f"stop_token_ids must be a list of ints, got {stops!r}")
        stops = tuple(stops)
        if not all(is_int(t) and t >= 0 for t in stops):
            raise SamplingParamsError(f"stop_token_ids must hold non-negative ints, got {list(stops)!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= LOGPROBS_MAX):
            raise SamplingParamsError(f"logprobs must be None or an int in [0, {LOGPROBS_MAX}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampled(NamedTuple):
    """One generated token; with logprobs requested, its logprob and the top alternatives
    ((id, logprob), most likely first), else None and ()."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(logprob of `token`, top-k (id, logprob) pairs) of fp32 logits [vocab] (vLLM's raw_logprobs).
    Tokens a grammar mask forbids (-inf) are never listed, so fewer than k may come back; equal
    logprobs list the lower id first (as the graph's kernels do)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = ()
    if k:
        vals, ids = torch.sort(lp, descending=True, stable=True)
        vals, ids = vals[:k], ids[:k]
        top = tuple((i, v) for i, v in zip(ids.tolist(), vals.tolist()) if v > float("-inf"))
    return float(lp[token]), top


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution a non-greedy step samples from: softmax(logits / T) restricted to the top_k
    tokens, then to the smallest set of most likely tokens whose mass reaches top_p; renormalised.
    logits [vocab], or [rows, vocab] for one distribution per row."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        vals, idx = torch.topk(logits, top_k, dim=-1)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, vals)
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        p = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(p, dim=-1) - p
        drop = mass_before >= top_p
        drop[..., 0] = False  # always keep the most likely token
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)


class Sampler:
    """Picks tokens from fp32 logits [vocab]; one per request, so a seed reproduces the request."""

    def __init__(self, params: SamplingParams, device: str | torch.device = "cpu"):
        self.params = params
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        probs = sampling_probs(logits, p.temperature, p.top_k, p.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))
