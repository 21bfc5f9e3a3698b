"""Tensor-parallel sharding of a request's state: which heads one part of a hand-off holds.

A prefill pool at TP = N ships a request's state as N parts (one per vLLM TP rank); a decode node
at TP = M holds M shards. Both split by heads, the way vLLM does:

* full attention: KV heads. With ``tp <= num_kv_heads`` rank r holds heads
  ``[r*kv/tp, (r+1)*kv/tp)``; with ``tp > num_kv_heads`` every rank holds one head, head
  ``r // (tp/kv)`` (``tp/kv`` replicas of each). A replicated head is shipped once, by its
  first replica (``r % replicas == 0``); the other replicas' parts carry no attention layers.
* Gated DeltaNet: key heads ``[r*nk/tp, ...)`` and value heads ``[r*nv/tp, ...)`` (vLLM requires
  ``tp`` to divide both). The conv state's channels are three segments, q | k | v (key, key,
  value heads), **each split separately**: a rank's conv channels are
  ``q[its key heads] | k[its key heads] | v[its value heads]``, not one slice of the concatenation.
  The recurrent state follows the value heads.

``Sharding`` names these ranges explicitly (global head indices, half-open), so a node never
re-derives a sender's rule; ``vllm_sharding`` is the rule. Pure Python (no torch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nexrt_vllm.handoff.protocol import ProtocolError, Reason

Range = tuple[int, int]


@dataclass(frozen=True)
class Sharding:
    """The heads one part (or one node rank) holds; ``kv_heads`` None: no attention state."""

    tp_size: int
    tp_rank: int
    kv_heads: Range | None
    k_heads: Range
    v_heads: Range

    def to_wire(self) -> dict:
        return {"tp_size": self.tp_size, "tp_rank": self.tp_rank,
                "kv_heads": None if self.kv_heads is None else list(self.kv_heads),
                "k_heads": list(self.k_heads), "v_heads": list(self.v_heads)}

    @classmethod
    def from_wire(cls, d: Any) -> "Sharding":
        if not isinstance(d, dict):
            raise ProtocolError(Reason.BAD_MESSAGE, "layout sharding must be a map")
        try:
            size, rank = d["tp_size"], d["tp_rank"]
            kv = d.get("kv_heads")
            out = cls(tp_size=size, tp_rank=rank, kv_heads=None if kv is None else _range(kv, "kv_heads"),
                      k_heads=_range(d["k_heads"], "k_heads"), v_heads=_range(d["v_heads"], "v_heads"))
        except KeyError as e:
            raise ProtocolError(Reason.BAD_MESSAGE, f"layout sharding lacks {e.args[0]!r}") from None
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (size, rank)) \
                or size < 1 or not 0 <= rank < size:
            raise ProtocolError(Reason.BAD_MESSAGE,
                                f"layout sharding: tp_rank {rank!r} must lie in [0, tp_size {size!r})")
        return out


def _range(x: Any, what: str) -> Range:
    if not isinstance(x, (list, tuple)) or len(x) != 2 or \
            not all(isinstance(v, int) and not isinstance(v, bool) for v in x) or not 0 <= x[0] <= x[1]:
        raise ProtocolError(Reason.BAD_MESSAGE, f"layout sharding {what} must be [start, end), got {x!r}")
    return int(x[0]), int(x[1])


def kv_heads_of(num_kv_heads: int, tp: int, rank: int) -> Range:
    """The KV heads vLLM gives TP rank ``rank`` (one replicated head when tp > num_kv_heads)."""
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(f"tp {tp} does not divide num_key_value_heads {num_kv_heads}")
        n = num_kv_heads // tp
        return rank * n, (rank + 1) * n
    if tp % num_kv_heads:
        raise ValueError(f"num_key_value_heads {num_kv_heads} does not divide tp {tp}")
    head = rank // (tp // num_kv_heads)
    return head, head + 1


def ships_kv(num_kv_heads: int, tp: int, rank: int) -> bool:
    """Whether this rank ships its attention pages: each replicated head once, by its first replica."""
    return tp <= num_kv_heads or rank % (tp // num_kv_heads) == 0


def split(total: int, tp: int, rank: int, what: str) -> Range:
    if total % tp:
        raise ValueError(f"tp {tp} does not divide {what} {total}")
    n = total // tp
    return rank * n, (rank + 1) * n


def vllm_sharding(num_kv_heads: int, num_k_heads: int, num_v_heads: int, tp: int, rank: int,
                  shipped: bool = True) -> Sharding:
    """vLLM's split for TP rank ``rank`` of ``tp``. ``shipped``: a hand-off part (a replicated KV head
    only on its first replica); False: what the rank holds (a node shard)."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside [0, {tp})")
    kv = kv_heads_of(num_kv_heads, tp, rank)
    if shipped and not ships_kv(num_kv_heads, tp, rank):
        kv = None
    return Sharding(tp, rank, kv, split(num_k_heads, tp, rank, "linear_num_key_heads"),
                    split(num_v_heads, tp, rank, "linear_num_value_heads"))


def check_cover(parts: list[Sharding], num_kv_heads: int, num_k_heads: int, num_v_heads: int,
                has_attention: bool = True) -> None:
    """Raise ProtocolError(LAYOUT_MISMATCH) unless the parts hold every head exactly once."""
    def bad(msg):
        raise ProtocolError(Reason.LAYOUT_MISMATCH, msg)

    for what, total, ranges in (
            ("KV head", num_kv_heads if has_attention else 0, [p.kv_heads for p in parts if p.kv_heads]),
            ("GDN key head", num_k_heads, [p.k_heads for p in parts]),
            ("GDN value head", num_v_heads, [p.v_heads for p in parts])):
        count = [0] * total
        for a, b in ranges:
            if b > total:
                bad(f"a part holds {what}s [{a}, {b}), the model has {total}")
            for h in range(a, b):
                count[h] += 1
        if any(c != 1 for c in count):
            missing = [h for h, c in enumerate(count) if c == 0]
            twice = [h for h, c in enumerate(count) if c > 1]
            bad(f"the parts do not hold each {what} once: missing {missing}, more than once {twice}")
