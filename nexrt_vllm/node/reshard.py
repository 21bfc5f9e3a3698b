"""Re-sharding a request's state: N prefill parts (vLLM TP = N) -> M node shards (TP = M).

Pure functions over native state tensors (names and layouts of docs/ARCHITECTURE.md §1, each
tensor holding only its shard's heads). What a part or a shard holds is a
`nexrt_vllm.handoff.sharding.Sharding`: global head ranges of KV heads, GDN key heads and GDN
value heads. Per layer:

* attention K/V ``[kv_heads, L, head_dim]``: KV heads gathered along dim 0 (a replicated head
  comes from the one part that shipped it, and goes to every node rank that holds it);
* GDN conv ``[conv_dim, kernel-1]``: the channels are three segments, q | k | v, of key, key and
  value heads; each segment is gathered separately (q of the target's key heads from the parts'
  q segments, and so on) — a shard's conv is never one slice of the concatenation;
* GDN recurrent ``[v_heads, dk, dv]``: value heads along dim 0.

A target that needs one piece of one part gets a view of it (no copy); otherwise a new tensor.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from nexrt_vllm.engine.state import AttentionState, GDNState
from nexrt_vllm.handoff.sharding import Range, Sharding, vllm_sharding

State = Mapping[str, torch.Tensor]


def whole(cfg) -> Sharding:
    """The sharding of an unsharded state (TP = 1)."""
    return Sharding(1, 0, (0, cfg.num_kv_heads), (0, cfg.linear_num_key_heads), (0, cfg.linear_num_value_heads))


def prefill_parts(cfg, n: int) -> list[Sharding]:
    """The N parts vLLM TP = n ships (each replicated KV head once)."""
    return [vllm_sharding(cfg.num_kv_heads, cfg.linear_num_key_heads, cfg.linear_num_value_heads, n, r)
            for r in range(n)]


def node_shards(cfg, m: int) -> list[Sharding]:
    """What each rank of a TP = m node holds (replicated KV heads on every replica)."""
    return [vllm_sharding(cfg.num_kv_heads, cfg.linear_num_key_heads, cfg.linear_num_value_heads, m, r,
                          shipped=False) for r in range(m)]


def _n(r: Range | None) -> int:
    return 0 if r is None else r[1] - r[0]


def _gather(sources: Sequence[tuple[Range, torch.Tensor]], want: Range, unit: int, what: str) -> torch.Tensor:
    """Heads [want) along dim 0 from sources that each hold heads [a, b) as `unit` rows per head."""
    lo, hi = want
    pieces, at = [], lo
    for (a, b), t in sorted(sources, key=lambda s: s[0]):
        s, e = max(a, at), min(b, hi)
        if s >= e:
            continue
        if s != at:
            break
        pieces.append(t.narrow(0, (s - a) * unit, (e - s) * unit))
        at = e
    if at != hi:
        raise ValueError(f"{what}: no part holds heads [{at}, {hi})")
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)


def _conv_segments(cfg, s: Sharding, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = _n(s.k_heads) * cfg.linear_key_head_dim
    return conv[:q], conv[q: 2 * q], conv[2 * q:]


def _records(cfg, s: Sharding, state: State, where: str) -> dict:
    """layer index -> the part's AttentionState / GDNState, shapes checked against its head ranges."""
    dk, dv, hd = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.head_dim
    out = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind == "full_attention" and s.kv_heads is None:
            continue
        cls = AttentionState if kind == "full_attention" else GDNState
        try:
            rec = cls.from_named(state, i)
        except KeyError as e:
            raise ValueError(f"{where} lacks {e.args[0]}") from None
        want = ({"k": (_n(s.kv_heads), None, hd), "v": (_n(s.kv_heads), None, hd)} if cls is AttentionState else
                {"conv": (2 * _n(s.k_heads) * dk + _n(s.v_heads) * dv, cfg.conv_kernel - 1),
                 "rec": (_n(s.v_heads), dk, dv)})
        for (name, t), (part, shape) in zip(rec.named(i).items(), want.items()):
            if t.dim() != len(shape) or any(w is not None and g != w for g, w in zip(t.shape, shape)):
                raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, its heads imply {shape}")
        out[i] = rec
    return out


def reshard(cfg, parts: Sequence[tuple[Sharding, State]], targets: Sequence[Sharding]) -> list[dict[str, torch.Tensor]]:
    """The state of every target from the parts (each head held by exactly one part).

    `cfg`: the model's (global) ModelConfig. Returns one dict per target with the native names;
    attention entries only for targets with KV heads, K/V with the parts' row count."""
    recs = [(s, _records(cfg, s, st, f"part {s.tp_rank} of {s.tp_size}")) for s, st in parts]
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    out: list[dict[str, torch.Tensor]] = [{} for _ in targets]
    for i, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            src = [(s, r[i]) for s, r in recs if s.kv_heads is not None]
            for t, dst in zip(targets, out):
                if t.kv_heads is not None:
                    dst.update(AttentionState(
                        k=_gather([(s.kv_heads, a.k) for s, a in src], t.kv_heads, 1, f"layer {i} K heads"),
                        v=_gather([(s.kv_heads, a.v) for s, a in src], t.kv_heads, 1, f"layer {i} V heads"),
                    ).named(i))
            continue
        segs = [(s, _conv_segments(cfg, s, r[i].conv), r[i].rec) for s, r in recs]
        for t, dst in zip(targets, out):
            what = f"layer {i} conv"
            q = _gather([(s.k_heads, g[0]) for s, g, _ in segs], t.k_heads, dk, f"{what} q segment")
            k = _gather([(s.k_heads, g[1]) for s, g, _ in segs], t.k_heads, dk, f"{what} k segment")
            v = _gather([(s.v_heads, g[2]) for s, g, _ in segs], t.v_heads, dv, f"{what} v segment")
            rec = _gather([(s.v_heads, r) for s, _, r in segs], t.v_heads, 1, f"layer {i} recurrent value heads")
            dst.update(GDNState(conv=torch.cat((q, k, v), 0), rec=rec).named(i))
    return out


def split_state(cfg, state: State, targets: Sequence[Sharding]) -> list[dict[str, torch.Tensor]]:
    """An unsharded state -> the targets' shards (1 -> M)."""
    return reshard(cfg, [(whole(cfg), state)], targets)


def merge_state(cfg, parts: Sequence[tuple[Sharding, State]]) -> dict[str, torch.Tensor]:
    """Shards -> the unsharded state (N -> 1)."""
    return reshard(cfg, parts, [whole(cfg)])[0]
