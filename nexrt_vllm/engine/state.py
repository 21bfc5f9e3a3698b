"""DecodeState: the static per-request buffers of one batch-1 decode (docs/ARCHITECTURE.md §1).

Allocated once for `max_seq_len`; a decode step only writes into these tensors, so their addresses
never change (a CUDA graph can capture the step). Native layout, one record per model layer `i`
(`state.layers[i]`, or `state.attention(i)` / `state.gdn(i)`):

- full attention, `AttentionState`: `k`, `v` [num_kv_heads, max_seq_len, head_dim], model dtype,
  rows post k-norm and post-RoPE; rows at and after `seq_len` are ignored (masked);
- GDN, `GDNState`: `conv` [conv_dim, kernel-1] model dtype, oldest column first, channels q|k|v;
  `rec` [num_v_heads, head_k_dim, head_v_dim] fp32.

The hand-off format (`export` / `load`, the node's page conversion) is a flat dict that names each
tensor `layers.{i}.<field>`; this module alone spells those names (`LayerState.named`,
`LayerState.from_named`).

`position` is `seq_len` as a device tensor (int64 [1]): the decode step reads the write position from
it and advances it on the device; `seq_len` is the host's copy, kept equal by the engine.
"""
from __future__ import annotations

import math

from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from nexrt_vllm.engine.config import ModelConfig
from nexrt_vllm.engine.errors import StateError


def _name(layer: int, part: str) -> str:
    return f"layers.{layer}.{part}"


@dataclass(frozen=True, eq=False)
class LayerState:
    """One layer's state tensors (a subclass per layer kind; eq=False: tensors do not compare to a bool)."""

    # Fields with one row per token along dim 1: export trims them to seq_len, reset leaves them.
    ROWS = ()

    def parts(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def named(self, index: int) -> dict[str, torch.Tensor]:
        """This record as entries of the hand-off dict, for model layer `index`."""
        return {_name(index, p): t for p, t in self.parts().items()}

    @classmethod
    def from_named(cls, tensors: Mapping[str, torch.Tensor], index: int) -> "LayerState":
        """Layer `index`'s record out of a hand-off dict (KeyError naming the entry if absent)."""
        return cls(**{f.name: tensors[_name(index, f.name)] for f in fields(cls)})


@dataclass(frozen=True, eq=False)
class AttentionState(LayerState):
    k: torch.Tensor
    v: torch.Tensor
    ROWS = ("k", "v")


@dataclass(frozen=True, eq=False)
class GDNState(LayerState):
    conv: torch.Tensor
    rec: torch.Tensor


def _layer_layouts(c: ModelConfig, max_seq_len: int, dtype: torch.dtype) \
        -> list[tuple[type[LayerState], dict[str, tuple[tuple[int, ...], torch.dtype]]]]:
    """Per model layer: its record type and each tensor's (shape, dtype)."""
    out = []
    for kind in c.layer_types:
        if kind == "full_attention":
            kv = ((c.num_kv_heads, max_seq_len, c.head_dim), dtype)
            out.append((AttentionState, {"k": kv, "v": kv}))
        else:
            out.append((GDNState, {
                "conv": ((c.conv_dim, c.conv_kernel - 1), dtype),
                "rec": ((c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), torch.float32)}))
    return out


class DecodeState:
    def __init__(self, cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                 over: tuple[list[LayerState], torch.Tensor] | None = None):
        """`over` = (layer records, position int64 [1]): existing tensors in the native layout to hold the
        state in (a slot of `StackedStates`) instead of allocating them."""
        if not isinstance(max_seq_len, int) or max_seq_len <= 0:
            raise StateError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        self.config = cfg
        self.max_seq_len = max_seq_len
        self.dtype = dtype
        self.device = torch.device(device)
        if over is not None:
            self.layers, self.position = over
        else:
            self.layers = [
                kind(**{p: torch.zeros(shape, dtype=dt, device=self.device) for p, (shape, dt) in parts.items()})
                for kind, parts in self._layer_layouts()]
            self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.seq_len = 0

    def _layer_layouts(self) -> list[tuple[type[LayerState], dict[str, tuple[tuple[int, ...], torch.dtype]]]]:
        return _layer_layouts(self.config, self.max_seq_len, self.dtype)

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Hand-off name -> (shape, dtype) of every state tensor."""
        return {_name(i, p): spec for i, (_, parts) in enumerate(self._layer_layouts()) for p, spec in parts.items()}

    def attention(self, i: int) -> AttentionState:
        return self._layer(i, AttentionState)

    def gdn(self, i: int) -> GDNState:
        return self._layer(i, GDNState)

    def _layer(self, i: int, kind: type[LayerState]):
        layer = self.layers[i]
        if not isinstance(layer, kind):
            raise StateError(f"layer {i} holds {type(layer).__name__}, not {kind.__name__}")
        return layer

    def buffers(self) -> list[torch.Tensor]:
        """Every state tensor (live, not copies), in layer order."""
        return [t for layer in self.layers for t in layer.parts().values()]

    def named(self) -> dict[str, torch.Tensor]:
        """The live state tensors under their hand-off names (no copy; K/V at full max_seq_len)."""
        return {k: t for i, layer in enumerate(self.layers) for k, t in layer.named(i).items()}

    def native_dtypes(self) -> dict[str, torch.dtype]:
        """Element types of the state: {"kv": attention K/V, "conv": GDN conv, "rec": GDN recurrent}."""
        return {"kv": self.dtype, "conv": self.dtype, "rec": torch.float32}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def reset(self) -> None:
        """Empty the state. KV rows need no clearing: rows at or after seq_len are masked."""
        for layer in self.layers:
            for p, t in layer.parts().items():
                if p not in layer.ROWS:
                    t.zero_()
        self.position.zero_()
        self.seq_len = 0

    def set_seq_len(self, n: int) -> None:
        self.seq_len = n
        self.position.fill_(n)

    def _rows(self) -> set[str]:
        """Hand-off names of the per-token tensors (trimmed on export, shorter on load)."""
        return {_name(i, p) for i, layer in enumerate(self.layers) for p in layer.ROWS}

    def export(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(seq_len, copies of the state by hand-off name): K/V trimmed to the seq_len valid rows."""
        n, rows = self.seq_len, self._rows()
        return n, {name: (t[:, :n] if name in rows else t).clone() for name, t in self.named().items()}

    def load(self, seq_len: int, tensors: dict[str, torch.Tensor], start: int = 0) -> None:
        """Replace the state with `tensors` (as `export` gives them, or K/V with up to max_seq_len rows).
        With `start`, K/V rows [0, start) stay as they are (the node's context cache filled them) and
        the K/V tensors hold rows [start, seq_len) (and possibly more, ignored).

        Validates everything before writing anything: names, shapes, dtypes, seq_len range.
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 0 < seq_len <= self.max_seq_len:
            raise StateError(f"seq_len must be an int in [1, {self.max_seq_len}], got {seq_len!r}")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= seq_len:
            raise StateError(f"start must be an int in [0, {seq_len}], got {start!r}")
        if not isinstance(tensors, dict):
            raise StateError(f"state must be a dict of tensors, got {type(tensors).__name__}")
        layout, rows = self.layout(), self._rows()
        problems = []
        missing = sorted(set(layout) - set(tensors))
        unexpected = sorted(set(tensors) - set(layout))
        if missing:
            problems.append(f"missing: {missing}")
        if unexpected:
            problems.append(f"unexpected: {unexpected}")
        for name in sorted(set(layout) & set(tensors)):
            t, (shape, dt) = tensors[name], layout[name]
            if not isinstance(t, torch.Tensor):
                problems.append(f"{name}: not a tensor ({type(t).__name__})")
                continue
            if name in rows:
                ok = t.dim() == 3 and (t.shape[0], t.shape[2]) == (shape[0], shape[2]) and \
                    seq_len - start <= t.shape[1] <= shape[1]
                want = f"({shape[0]}, L, {shape[2]}) with {seq_len - start} <= L <= {shape[1]}"
            else:
                ok, want = tuple(t.shape) == shape, str(shape)
            if not ok:
                problems.append(f"{name}: shape {tuple(t.shape)}, expected {want}")
            if t.dtype != dt:
                problems.append(f"{name}: dtype {t.dtype}, expected {dt}")
        if problems:
            raise StateError("state does not match the native layout: " + "; ".join(problems))
        live = self.named()
        for name, t in tensors.items():
            if name in rows:
                live[name][:, start:seq_len].copy_(t[:, :seq_len - start])
            else:
                live[name].copy_(t)
        self.set_seq_len(seq_len)


class StackedStates:
    """The states of `n` requests decoded together (`--max-batch`): one allocation per state tensor
    with a leading slot dimension [n, ...] and the positions as one int64 [n], so a batched kernel
    reaches slot b's tensors by a stride. `states[b]` is slot b's `DecodeState`, whose tensors are
    views of slot b (the hand-off, the eager step and export read and write it as any state).
    `attention(i)` / `gdn(i)` give layer i's stacked record (the batch step's view).

    `pad_rows`: each stacked tensor's allocation runs that many rows (of its last dimension) past its
    end, so a kernel may read a little past the last slot's last row (the batched speculative round's
    rows past a context's end, kernels/batch_round.py) without leaving the allocation."""

    def __init__(self, cfg: ModelConfig, n: int, max_seq_len: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", pad_rows: int = 0):
        if not isinstance(n, int) or n < 1:
            raise StateError(f"the number of slots must be a positive int, got {n!r}")
        self.config, self.n, self.max_seq_len, self.dtype = cfg, n, max_seq_len, dtype
        self.device = torch.device(device)

        def stacked(shape, dt):
            count = n * math.prod(shape)
            return torch.zeros(count + pad_rows * shape[-1], dtype=dt, device=self.device)[:count].view(n, *shape)

        self.layers: list[LayerState] = [
            kind(**{p: stacked(shape, dt) for p, (shape, dt) in parts.items()})
            for kind, parts in _layer_layouts(cfg, max_seq_len, dtype)]
        self.position = torch.zeros(n, dtype=torch.long, device=self.device)
        self.states = [DecodeState(cfg, max_seq_len, dtype, self.device, over=(
            [type(layer)(**{p: t[b] for p, t in layer.parts().items()}) for layer in self.layers],
            self.position[b:b + 1])) for b in range(n)]

    def attention(self, i: int) -> AttentionState:
        self.states[0].attention(i)  # StateError unless layer i is an attention layer
        return self.layers[i]

    def gdn(self, i: int) -> GDNState:
        self.states[0].gdn(i)
        return self.layers[i]

    def buffers(self) -> list[torch.Tensor]:
        """Every stacked state tensor (live), in layer order, then the positions."""
        return [t for layer in self.layers for t in layer.parts().values()] + [self.position]
