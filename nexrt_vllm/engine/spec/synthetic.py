"""Pinned ("synthetic") acceptance for speculative-decoding benchmarks, with vLLM's semantics.

Speculative systems are compared at one acceptance length (InferenceX pins a "golden" mean tokens
per round per model and draft length, e.g. 3.39 for Qwen3.5 MTP with 3 drafts); random or grafted
weights would otherwise make acceptance meaningless. With a schedule set, each verify round accepts
`a` drafts drawn from it instead of comparing drafts with the target, and emits the real draft
tokens d_1..d_a then the target's own token after them, so the work per round and the state it
commits are a real round's; only which drafts count as accepted is forced. Off by default.

The schedule is vLLM 0.33's (`rejection_sample_method: "synthetic"`): `rates[i]` is the
*unconditional* probability that the first i+1 drafts are all accepted, non-increasing, each in
[0, 1]. From a mean length L with n drafts, the minimum-variance schedule is
`[1.0] * floor(L-1) + [frac(L-1)] + [0.0] * rest` (L = 3.39, n = 3: 1.0, 1.0, 0.39 - every round
accepts 2 or 3 drafts, 3.39 tokens on average). Pure Python: the node's CLI and the benchmarks use it.
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence


class SyntheticAcceptanceError(ValueError):
    """A synthetic acceptance length or rate list that no schedule of `num_drafts` drafts can give."""


def rates_for_length(length: float, num_drafts: int) -> tuple[float, ...]:
    """The minimum-variance unconditional per-position rates with mean tokens per round `length`."""
    if isinstance(num_drafts, bool) or not isinstance(num_drafts, int) or num_drafts < 1:
        raise SyntheticAcceptanceError(f"num_drafts must be a positive int, got {num_drafts!r}")
    if isinstance(length, bool) or not isinstance(length, (int, float)) or not math.isfinite(length) \
            or not 1.0 <= length <= num_drafts + 1:
        raise SyntheticAcceptanceError(f"synthetic acceptance length must be in [1, {num_drafts + 1}] "
                                       f"(tokens per round with {num_drafts} drafts), got {length!r}")
    extra = float(length) - 1.0
    whole = min(int(math.floor(extra)), num_drafts)
    rates = [1.0] * whole
    if whole < num_drafts:
        rates.append(round(extra - whole, 12))
    rates += [0.0] * (num_drafts - len(rates))
    return tuple(rates)


def check_rates(rates: Sequence[float], num_drafts: int) -> tuple[float, ...]:
    """`rates` as a tuple, or SyntheticAcceptanceError naming what is wrong."""
    try:
        out = tuple(float(r) for r in rates)
    except (TypeError, ValueError):
        raise SyntheticAcceptanceError(f"synthetic acceptance rates must be numbers, got {rates!r}") from None
    if len(out) != num_drafts:
        raise SyntheticAcceptanceError(f"synthetic acceptance rates: one per draft position ({num_drafts}), "
                                       f"got {len(out)}")
    if any(not (0.0 <= r <= 1.0) for r in out):
        raise SyntheticAcceptanceError(f"synthetic acceptance rates must each be in [0, 1], got {list(out)}")
    if any(b > a for a, b in zip(out, out[1:])):
        raise SyntheticAcceptanceError(f"synthetic acceptance rates are unconditional, so non-increasing; "
                                       f"got {list(out)}")
    return out


class SyntheticAcceptance:
    """A seeded stream of accepted-draft counts with P(count >= i + 1) = rates[i]."""

    def __init__(self, rates: Sequence[float], seed: int = 0):
        self.rates = check_rates(rates, len(rates))
        self.seed = int(seed)
        self._rng = random.Random(self.seed)

    @classmethod
    def from_length(cls, length: float, num_drafts: int, seed: int = 0) -> SyntheticAcceptance:
        return cls(rates_for_length(length, num_drafts), seed)

    @property
    def num_drafts(self) -> int:
        return len(self.rates)

    @property
    def length(self) -> float:
        """Mean tokens per round: the bonus token plus the expected accepted drafts."""
        return 1.0 + sum(self.rates)

    def draw(self) -> int:
        """Accepted drafts of the next round (one uniform against the non-increasing rates)."""
        u = self._rng.random()
        return sum(1 for r in self.rates if u < r)

    def draws(self, n: int) -> list[int]:
        return [self.draw() for _ in range(n)]

    def describe(self) -> dict:
        """What result files and /capabilities report."""
        return {"acceptance_length": round(self.length, 6), "rates": list(self.rates), "seed": self.seed}
