"""DecodeState: the static per-request buffers of one batch-1 decode (docs/ARCHITECTURE.md §1).

Allocated once for `max_seq_len`; a decode step only writes into these tensors, so their addresses
never change (a CUDA graph can capture the step). Native layout, per model layer `i`:

- full attention: `layers.{i}.k`, `layers.{i}.v` [num_kv_heads, max_seq_len, head_dim], model dtype,
  rows post k-norm and post-RoPE; rows at and after `seq_len` are ignored (masked);
- GDN: `layers.{i}.conv` [conv_dim, kernel-1] model dtype, oldest column first, channels q|k|v;
  `layers.{i}.rec` [num_v_heads, head_k_dim, head_v_dim] fp32.

`position` is `seq_len` as a device tensor (int64 [1]): the decode step reads the write position from
it and advances it on the device; `seq_len` is the host's copy, kept equal by the engine.
"""
from __future__ import annotations

import torch

from .config import ModelConfig
from .errors import StateError


class DecodeState:
    def __init__(self, cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype, device: str | torch.device = "cpu"):
        if not isinstance(max_seq_len, int) or max_seq_len <= 0:
            raise StateError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        self.config = cfg
        self.max_seq_len = max_seq_len
        self.dtype = dtype
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}
        for name, (shape, dt) in self.layout().items():
            self.tensors[name] = torch.zeros(shape, dtype=dt, device=self.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.seq_len = 0

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every state tensor."""
        c = self.config
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for i, kind in enumerate(c.layer_types):
            if kind == "full_attention":
                kv = (c.num_kv_heads, self.max_seq_len, c.head_dim)
                out[f"layers.{i}.k"] = (kv, self.dtype)
                out[f"layers.{i}.v"] = (kv, self.dtype)
            else:
                out[f"layers.{i}.conv"] = ((c.conv_dim, c.conv_kernel - 1), self.dtype)
                out[f"layers.{i}.rec"] = ((c.linear_num_value_heads, c.linear_key_head_dim,
                                           c.linear_value_head_dim), torch.float32)
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def reset(self) -> None:
        """Empty the state. KV rows need no clearing: rows at or after seq_len are masked."""
        for name, t in self.tensors.items():
            if not name.endswith((".k", ".v")):
                t.zero_()
        self.position.zero_()
        self.seq_len = 0

    def set_seq_len(self, n: int) -> None:
        self.seq_len = n
        self.position.fill_(n)

    def export(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(seq_len, copies of the state): K/V trimmed to the seq_len valid rows."""
        n = self.seq_len
        return n, {name: (t[:, :n] if name.endswith((".k", ".v")) else t).clone()
                   for name, t in self.tensors.items()}

    def load(self, seq_len: int, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the state with `tensors` (as `export` gives them, or K/V with up to max_seq_len rows).

        Validates everything before writing anything: names, shapes, dtypes, seq_len range.
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 0 < seq_len <= self.max_seq_len:
            raise StateError(f"seq_len must be an int in [1, {self.max_seq_len}], got {seq_len!r}")
        if not isinstance(tensors, dict):
            raise StateError(f"state must be a dict of tensors, got {type(tensors).__name__}")
        layout = self.layout()
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
            if name.endswith((".k", ".v")):
                ok = t.dim() == 3 and (t.shape[0], t.shape[2]) == (shape[0], shape[2]) and \
                    seq_len <= t.shape[1] <= shape[1]
                want = f"({shape[0]}, L, {shape[2]}) with {seq_len} <= L <= {shape[1]}"
            else:
                ok, want = tuple(t.shape) == shape, str(shape)
            if not ok:
                problems.append(f"{name}: shape {tuple(t.shape)}, expected {want}")
            if t.dtype != dt:
                problems.append(f"{name}: dtype {t.dtype}, expected {dt}")
        if problems:
            raise StateError("state does not match the native layout: " + "; ".join(problems))
        for name, t in tensors.items():
            dst = self.tensors[name]
            if name.endswith((".k", ".v")):
                dst[:, :seq_len].copy_(t[:, :seq_len])
            else:
                dst.copy_(t)
        self.set_seq_len(seq_len)
