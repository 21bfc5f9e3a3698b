"""The parts of one hand-off: a prefill pool at TP = N ships a request as N parts, one per vLLM TP
rank, each with its own ``begin`` (its layout's ``sharding`` names it), page writes and
``done``/``abort`` (``part`` = its tp_rank). An unsharded hand-off is one part.

The node gives each part its own slice of the admission's receive buffer (bump-allocated in the
order the begins arrive), validates every part's layout against the heads it claims, checks that
the N parts hold every head exactly once, and calls the admission complete only when every
part's ``done`` arrived. `load_parts` then converts each part and re-shards the N parts into the
node's M engine shards (`nexrt_vllm.node.reshard`).

An unsharded hand-off into a one-device engine may start from rows the node's context cache holds
(``PartSet.prefix``, ``nexrt_vllm.node.context_cache``): its regions then hold only the pages from
``held`` tokens on, and `load_parts` fills the held rows before loading the received ones.
"""
from __future__ import annotations

from dataclasses import dataclass

from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.sharding import Sharding, check_cover
from nexrt_vllm.node.context_cache import Prefix
from nexrt_vllm.node.convert import unpack_state
from nexrt_vllm.node.reshard import node_shards, reshard, whole


def check_part(layout: L.Layout, cfg) -> None:
    """Raise ProtocolError(LAYOUT_MISMATCH) unless a sharded layout describes the heads it names.

    A part carries every GDN layer (its key/value heads) and, if it holds KV heads, every
    attention layer; page shapes follow from its head counts."""
    s: Sharding = layout.sharding
    if s is None:
        return L.check_layout(layout, cfg)

    def bad(msg):
        raise P.ProtocolError(P.Reason.LAYOUT_MISMATCH, f"part {s.tp_rank} of {s.tp_size}: {msg}")

    L.check_dtypes(layout)
    for k, want in L.model_identity(cfg).items():
        if k in layout.model and layout.model[k] != want:
            bad(f"model {k}={layout.model[k]!r}, node serves {want!r}")
    if "num_hidden_layers" not in layout.model:
        bad("layout.model lacks num_hidden_layers")
    for what, r, total in (("KV heads", s.kv_heads, cfg.num_kv_heads),
                           ("GDN key heads", s.k_heads, cfg.linear_num_key_heads),
                           ("GDN value heads", s.v_heads, cfg.linear_num_value_heads)):
        if r is not None and r[1] > total:
            bad(f"{what} [{r[0]}, {r[1]}) outside the model's {total}")
    nkv = 0 if s.kv_heads is None else s.kv_heads[1] - s.kv_heads[0]
    nk, nv = s.k_heads[1] - s.k_heads[0], s.v_heads[1] - s.v_heads[0]
    if nk * (cfg.linear_num_value_heads // cfg.linear_num_key_heads) != nv or \
            s.v_heads[0] != s.k_heads[0] * (cfg.linear_num_value_heads // cfg.linear_num_key_heads):
        bad(f"value heads {list(s.v_heads)} are not those of key heads {list(s.k_heads)}")
    want = set(cfg.gdn_layers) | (set(cfg.attention_layers) if nkv else set())
    got = {layer.index for layer in layout.layers}
    if got != want:
        bad(f"layout covers layers {sorted(got)}, its heads need {sorted(want)}")
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for layer in layout.layers:
        if cfg.layer_types[layer.index] == "full_attention":
            if layer.kind != "attention":
                bad(f"layer {layer.index}: node has full attention, sender says {layer.kind}")
            shape = (nkv, layout.block_size, 2 * cfg.head_dim)
            if tuple(layer.shape) != shape:
                bad(f"layer {layer.index}: page shape {tuple(layer.shape)}, its {nkv} KV heads need {shape}")
        else:
            if layer.kind != "gdn":
                bad(f"layer {layer.index}: node has GDN, sender says {layer.kind}")
            conv = (2 * nk * dk + nv * dv, cfg.conv_kernel - 1)
            if (layer.conv_dim, layer.conv_width) != conv:
                bad(f"layer {layer.index}: conv (dim, width) {(layer.conv_dim, layer.conv_width)}, "
                    f"its heads need {conv} (q|k|v of {nk} key and {nv} value heads)")
            if layer.rec_dims != (nv, dk, dv):
                bad(f"layer {layer.index}: recurrent (heads, dk, dv) {layer.rec_dims}, expected {(nv, dk, dv)}")


@dataclass
class Part:
    index: int  # the sender's tp_rank (0 for an unsharded hand-off)
    layout: L.Layout
    regions: list[P.Region]
    expected_bytes: int
    done: bool = False
    aborted: bool = False


class PartSet:
    """One admission's parts: planned at their begins, complete when all N are done."""

    def __init__(self, n: int, seq_len: int, prefix: Prefix | None = None):
        self.n, self.seq_len = n, seq_len
        self.prefix = prefix or Prefix()  # the context cache's rows this hand-off starts from, if any
        self.parts: dict[int, Part] = {}
        self.end = 0  # first byte after the planned regions

    @property
    def held(self) -> int:
        """Leading tokens whose attention rows the node holds (they do not travel)."""
        return self.prefix.held

    def plan(self, layout: L.Layout, seq_len: int, capacity: int) -> Part:
        """Regions for a new part (ProtocolError when it does not fit with the others)."""
        s = layout.sharding
        index, n = (0, 1) if s is None else (s.tp_rank, s.tp_size)
        if n != self.n:
            raise P.ProtocolError(P.Reason.LAYOUT_MISMATCH, f"part says tp_size {n}, the first part said {self.n}")
        if seq_len != self.seq_len:
            raise P.ProtocolError(P.Reason.SIZE_MISMATCH,
                                  f"part {index} begins with seq_len {seq_len}, the first part said {self.seq_len}")
        if index in self.parts:
            raise P.ProtocolError(P.Reason.DUPLICATE, f"part {index} of {n} already began")
        if self.parts and (s is None) != (next(iter(self.parts.values())).layout.sharding is None):
            raise P.ProtocolError(P.Reason.LAYOUT_MISMATCH, "sharded and unsharded parts mixed")
        regions = layout.regions(seq_len, base=self.end, held=self.held)
        end = regions[-1].offset + regions[-1].nbytes if regions else self.end
        if end > capacity:
            raise P.ProtocolError(P.Reason.TOO_LONG, f"state needs {end} bytes (parts so far), "
                                                      f"receive buffer holds {capacity}")
        part = Part(index, layout, regions, sum(r.nbytes for r in regions))
        self.parts[index], self.end = part, end
        return part

    def check_cover(self, cfg) -> None:
        """Once all N parts began: each head held once (ProtocolError LAYOUT_MISMATCH)."""
        if self.n > 1 and len(self.parts) == self.n:
            check_cover([p.layout.sharding for p in self.parts.values()], cfg.num_kv_heads,
                        cfg.linear_num_key_heads, cfg.linear_num_value_heads, bool(cfg.attention_layers))

    def missing(self) -> list[int]:
        """Parts not done yet (never begun included)."""
        return [i for i in range(self.n) if i not in self.parts or not self.parts[i].done]

    def live(self) -> set[int]:
        """Parts that began and may still be writing."""
        return {i for i, p in self.parts.items() if not (p.done or p.aborted)}

    @property
    def complete(self) -> bool:
        return len(self.parts) == self.n and all(p.done for p in self.parts.values())

    @property
    def nbytes(self) -> int:
        return sum(p.expected_bytes for p in self.parts.values())


def load_parts(engine, raw, parts: PartSet, dtypes) -> None:
    """Convert the received parts and load them into the engine (TP = 1 or a TPEngine's M shards).
    The MTP drafter's K/V (layout version 4, a speculating prefill vLLM) become the context of the
    engine's own drafter when it speculates (`Speculator.import_context`), else are dropped."""
    cfg, tp = engine.config, getattr(engine, "tp", 1)
    if parts.n == 1 and tp == 1:  # the unsharded hand-off: no re-sharding
        p, held = parts.parts[0], parts.held
        target, drafter = _split(unpack_state(raw, p.layout, p.regions, parts.seq_len, dtypes, held), cfg)
        parts.prefix.fill(engine.state)  # the held rows, from the context cache
        engine.import_state(parts.seq_len, target, start=held)
        spec = getattr(engine, "speculative", None)
        if spec is not None and drafter:
            spec.import_context(parts.seq_len, drafter)
        return
    if parts.held:
        raise P.ProtocolError(P.Reason.BAD_MESSAGE, "held rows with a sharded hand-off or engine")
    states = [(p.layout.sharding or whole(cfg), _split(unpack_state(raw, p.layout, p.regions, parts.seq_len, dtypes),
                                                        cfg)[0]) for p in parts.parts.values()]
    shards = reshard(cfg, states, node_shards(cfg, tp))
    if tp == 1:
        engine.import_state(parts.seq_len, shards[0])
    else:
        engine.import_shards(parts.seq_len, shards)


def _split(state: dict, cfg) -> tuple[dict, dict]:
    """A converted part's (target model tensors, {"k", "v"} of MTP layer 0 or {}): the MTP drafter's
    layers are those past the target's (layout version 4)."""
    target = {k: t for k, t in state.items() if int(k.split(".")[1]) < cfg.num_layers}
    n = cfg.num_layers
    return target, {p: state[f"layers.{n}.{p}"] for p in ("k", "v") if f"layers.{n}.{p}" in state}
