"""Block-scaled FP8 weights kept as the checkpoint stores them (the GPU path reads them natively).

Hugging Face fine-grained FP8 (config.FP8BlockQuant) stores a Linear weight [N, K] as float8_e4m3fn
plus an fp32 `weight_scale_inv` [ceil(N/bn), ceil(K/bk)]: weight = e4m3 * scale of its block. On
CPU the loader dequantizes at load (the oracle); with `keep_fp8` it returns `FP8Weight`s instead,
which the fused kernels read directly (weight-only: fp32 accumulation against bf16 activations)
and the eager ops dequantize per use into exactly the values the oracle holds.

`FP8Weight.srow` maps every weight row to its row of `scale`. For one checkpoint tensor that is
r // bn; a concatenation (the engine fuses q|k|v, [gate; up], the GDN in_proj parts) keeps every
source's own scale grid - its scale rows are appended and its srow entries offset - and a row
permutation (Qwen3-Next's in_proj regrouping) permutes srow. So no weight is ever re-quantized:
every path multiplies the stored e4m3 values by the stored scales.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn

# Canonical-name endings of the projections the engine may keep in fp8 (what the fused GEMV / MoE
# kernels read). Everything else a checkpoint stores in fp8 (an embedding, a conv filter) is
# dequantized at load: the kernels reading those take bf16.
KEEP_SUFFIXES = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
    "linear_attn.in_proj_a.weight", "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight",
    "linear_attn.out_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight",
    "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight", "mlp.shared_expert_gate.weight",
    "lm_head.weight",
)
# What the family's published FP8 checkpoints (Qwen3.5 / Qwen3.6 / Qwen3-Next -FP8) leave in bf16
# besides the 1-D tensors, conv filters and embeddings: the head, the MoE router and shared-expert
# gate, and the GDN's small b / a projections (nv rows: their errors would move the decay gates).
PUBLISHED_NOT_CONVERT = ("lm_head", "mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a",
                         "linear_attn.in_proj_b", "linear_attn.in_proj_ba")


def keepable(canonical_name: str) -> bool:
    return canonical_name.endswith(KEEP_SUFFIXES)


def grid_rows(n: int, block_n: int, device=None) -> torch.Tensor:
    """srow of one tensor with n rows: r // block_n."""
    return (torch.arange(n, dtype=torch.int32, device=device) // block_n).to(torch.int32)


@dataclass(eq=False)
class FP8Weight:
    """q [..., N8, K] float8_e4m3fn; scale [..., S, ceil(K/bk)] fp32; srow int32 [N8] (scale row of
    each row of q, the same for every leading index: experts share one grid); block (bn, bk).
    `tail`: bf16 rows [..., N - N8, K] after the fp8 ones (a fused projection whose last sources the
    checkpoint keeps in bf16, e.g. the GDN in_proj's b / a); None for a plain checkpoint weight."""
    q: torch.Tensor
    scale: torch.Tensor
    srow: torch.Tensor
    block: tuple[int, int]
    tail: torch.Tensor | None = None
    _uniform: dict = field(default_factory=dict, repr=False)  # row_uniform answers (it reads srow on the host)

    def __post_init__(self):
        if self.q.dtype != torch.float8_e4m3fn:
            raise TypeError(f"FP8Weight.q must be float8_e4m3fn, got {self.q.dtype}")
        if self.scale.dtype != torch.float32:
            raise TypeError(f"FP8Weight.scale must be float32, got {self.scale.dtype}")
        n, k = self.q.shape[-2:]
        if tuple(self.srow.shape) != (n,):
            raise ValueError(f"FP8Weight.srow has shape {tuple(self.srow.shape)}, q has {n} rows")
        if self.scale.shape[-1] != -(-k // self.block[1]):
            raise ValueError(f"FP8Weight.scale has {self.scale.shape[-1]} column blocks, K {k} with "
                             f"block_k {self.block[1]} needs {-(-k // self.block[1])}")

    # ---- tensor-like -------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        n = self.q.shape[-2] + (0 if self.tail is None else self.tail.shape[-2])
        return torch.Size((*self.q.shape[:-2], n, self.q.shape[-1]))

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def n8(self) -> int:
        """Rows stored in fp8 (the first ones)."""
        return self.q.shape[-2]

    def nbytes(self) -> int:
        """Bytes a kernel reads to stream the whole weight once: e4m3 values, scales, the row map, tail."""
        tail = 0 if self.tail is None else self.tail.numel() * self.tail.element_size()
        return self.q.numel() + self.scale.numel() * 4 + self.srow.numel() * 4 + tail

    def __getitem__(self, e: int) -> "FP8Weight":
        """Expert e of a stacked [E, N, K] weight."""
        return FP8Weight(self.q[e], self.scale[e], self.srow, self.block,
                         None if self.tail is None else self.tail[e])

    def index_select(self, dim: int, index: torch.Tensor) -> "FP8Weight":
        if dim != 0 or self.q.dim() != 3:
            raise ValueError("FP8Weight.index_select: experts only (dim 0 of a stacked [E, N, K] weight)")
        return FP8Weight(self.q.index_select(0, index), self.scale.index_select(0, index), self.srow, self.block,
                         None if self.tail is None else self.tail.index_select(0, index))

    def full_scale(self) -> torch.Tensor:
        """fp32 [..., N8, K]: every element's scale."""
        k = self.q.shape[-1]
        s = self.scale.index_select(-2, self.srow.long())
        return s.repeat_interleave(self.block[1], dim=-1)[..., :k]

    def dequant(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype`: e4m3 * scale in fp32, then one rounding; equal to the loader's
        dequantize-at-load (weights.dequant_fp8_block) element for element."""
        w = (self.q.float() * self.full_scale()).to(dtype)
        if self.tail is not None:
            w = torch.cat([w, self.tail.to(dtype)], dim=-2)
        return w

    def row_uniform(self, block_rows: int, offset: int = 0) -> bool:
        """Whether each run of `block_rows` rows starting at offset + multiples of block_rows (the
        rows one kernel program reads) maps to a single scale row. Cached: the first launch (a warm-up,
        before any CUDA graph capture) asks; a captured launch must not read the device."""
        key = (block_rows, offset)
        if key not in self._uniform:
            self._uniform[key] = self._row_uniform(block_rows, offset)
        return self._uniform[key]

    def _row_uniform(self, block_rows: int, offset: int) -> bool:
        n = self.n8 - offset
        if n <= 0:
            return True
        s = self.srow[offset:].long().cpu()
        pad = -n % block_rows
        if pad:
            s = torch.cat([s, s[-1:].expand(pad)])
        s = s.view(-1, block_rows)
        return bool((s == s[:, :1]).all())


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """F.linear for a plain weight or an FP8Weight (dequantized for this use)."""
    if isinstance(w, FP8Weight):
        w = w.dequant(x.dtype)
    return torch.nn.functional.linear(x, w)


def cat_rows(parts: list) -> FP8Weight:
    """Row-concatenate FP8Weights (each keeps its own scale grid), then any bf16 parts as the tail.
    Every fp8 part must come before every bf16 part."""
    fp8 = [p for p in parts if isinstance(p, FP8Weight)]
    if not fp8:
        raise ValueError("cat_rows needs at least one FP8Weight")
    first_bf16 = next((i for i, p in enumerate(parts) if not isinstance(p, FP8Weight)), len(parts))
    if any(isinstance(p, FP8Weight) for p in parts[first_bf16:]) or any(p.tail is not None for p in fp8[:-1]):
        raise ValueError("cat_rows: bf16 rows may only follow every fp8 row")
    if len({p.block for p in fp8}) != 1:
        raise ValueError(f"cat_rows: parts with different block sizes {[p.block for p in fp8]}")
    srow, off = [], 0
    for p in fp8:
        srow.append(p.srow + off)
        off += p.scale.shape[-2]
    tails = ([fp8[-1].tail] if fp8[-1].tail is not None else []) + list(parts[first_bf16:])
    return FP8Weight(torch.cat([p.q for p in fp8], dim=-2), torch.cat([p.scale for p in fp8], dim=-2),
                     torch.cat(srow).to(torch.int32), fp8[0].block, torch.cat(tails, dim=-2) if tails else None)


def stack_experts(rows: list[list[FP8Weight]]) -> FP8Weight:
    """Experts' stacked weight [E, N, K] from each expert's parts (e.g. its gate and up tensors), each part
    keeping its own scale grid (`cat_rows`); the experts share one grid, as a checkpoint's do."""
    cats = [cat_rows(r) for r in rows]
    return FP8Weight(torch.stack([c.q for c in cats]), torch.stack([c.scale for c in cats]), cats[0].srow,
                     cats[0].block)


def split_views(fused: FP8Weight, parts: list) -> list:
    """Views of `fused` (from cat_rows(parts)) standing in for each part: FP8Weights over the fused
    q / scale rows (their own srow), tensors over the tail."""
    out, r, s, t = [], 0, 0, 0
    for p in parts:
        if isinstance(p, FP8Weight):
            n, m = p.q.shape[-2], p.scale.shape[-2]
            out.append(FP8Weight(fused.q[..., r:r + n, :], fused.scale[..., s:s + m, :], p.srow, p.block))
            r, s = r + n, s + m
        else:
            n = p.shape[-2]
            out.append(fused.tail[..., t:t + n, :])
            t += n
    return out


def take_rows(w, index: torch.Tensor):
    """Rows `index` of a 2-D weight (a copy of the values; an FP8Weight keeps its scales, srow follows)."""
    if isinstance(w, FP8Weight):
        if w.tail is not None:
            raise ValueError("take_rows: an FP8Weight with a bf16 tail")
        return FP8Weight(w.q.index_select(0, index), w.scale, w.srow.index_select(0, index), w.block)
    return w.index_select(0, index)


def quantize_block(w: torch.Tensor, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale_inv [..., ceil(N/bn), ceil(K/bk)]): scale = block amax / 448, as
    Hugging Face's fine-grained FP8 quantizer does."""
    n, k = w.shape[-2:]
    nb, kb = -(-n // block_n), -(-k // block_k)
    w = w.float()
    padded = torch.nn.functional.pad(w, (0, kb * block_k - k, 0, nb * block_n - n))
    blocks = padded.reshape(*w.shape[:-2], nb, block_n, kb, block_k)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(block_n, dim=-2).repeat_interleave(block_k, dim=-1)[..., :n, :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def quantize_weight(w: torch.Tensor, block: tuple[int, int], parts: tuple[int, ...] | None = None) -> FP8Weight:
    """`w` [..., N, K] quantized into HF's block format; `parts` (row counts summing to N): quantize
    each run of rows as its own checkpoint tensor (per-expert gate / up, say) and concatenate."""
    bn, bk = block
    if parts is None:
        q, s = quantize_block(w, bn, bk)
        return FP8Weight(q, s, grid_rows(w.shape[-2], bn, w.device), block)
    pieces, r = [], 0
    for n in parts:
        pieces.append(quantize_weight(w[..., r:r + n, :], block))
        r += n
    if r != w.shape[-2]:
        raise ValueError(f"quantize_weight: parts {parts} do not sum to {w.shape[-2]} rows")
    return cat_rows(pieces)


def _not_converted(module: str, patterns: tuple[str, ...]) -> bool:
    import re
    return any(re.match(f"{p}\\.", module) or re.match(p, module) or module.endswith(p) for p in patterns)


def quantize_tensors(tensors: dict, cfg, block: tuple[int, int] = (128, 128),
                     not_convert: tuple[str, ...] = PUBLISHED_NOT_CONVERT) -> dict:
    """A model's canonical tensors with every keepable projection not in `not_convert` replaced by its
    FP8Weight (stacked experts quantized per expert and per gate / up half, as the published
    checkpoints store them); the originals are dropped as they are replaced (one at a time, so a
    large model needs little extra memory). For benchmarks at real shapes: synthetic or grafted
    weights in the format an FP8 checkpoint loads into."""
    out = {}
    for name in list(tensors):
        t = tensors.pop(name)
        module = name[:-len(".weight")] if name.endswith(".weight") else name
        if not keepable(name) or _not_converted(module, not_convert) or (
                name == "lm_head.weight" and cfg.tie_word_embeddings):
            out[name] = t
            continue
        parts = (cfg.moe_intermediate_size,) * 2 if name.endswith("experts.gate_up_proj") else None
        out[name] = quantize_weight(t, block, parts)
        del t
    return out


__all__ = ["FP8Weight", "FP8_MAX", "KEEP_SUFFIXES", "PUBLISHED_NOT_CONVERT", "keepable", "grid_rows", "linear",
           "cat_rows", "stack_experts", "split_views", "take_rows", "quantize_block", "quantize_weight",
           "quantize_tensors"]
