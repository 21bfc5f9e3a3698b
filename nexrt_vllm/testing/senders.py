"""Stand-in senders for tests and benchmarks: the layout descriptor of vLLM-like contiguous pages
for a model (``layout_for``) and the engine's native state scattered into such pages
(``pack_state``, the inverse of the node's ``nexrt_vllm.node.convert.unpack_state``), so a test
can play the prefill side with the NexRT engine instead of vLLM.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from nexrt_vllm.engine.dtypes import TORCH_DTYPES
from nexrt_vllm.engine.state import AttentionState, GDNState
from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P


def layout_for(cfg, *, block_size: int = 16, kv_dtype: str = "bfloat16", conv_dtype: str = "bfloat16",
               rec_dtype: str = "float32", conv_layout: str = "SD", rec_layout: str = "HVK",
               kv_format: str = "packed", kv_interior: str = "HND") -> L.Layout:
    """The descriptor of vLLM-like pages for ``cfg`` (sender-side choices as arguments).
    ``kv_interior``: ``"HND"`` heads outside tokens (vLLM's LBHNC, CPU), ``"NHD"`` tokens outside
    heads (LBNHC, FlashAttention's default on GPUs)."""
    layers: list[L.LayerLayout] = []
    w = cfg.conv_kernel - 1
    h, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for i, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            shape = (cfg.num_kv_heads, block_size, 2 * cfg.head_dim)
            strides = L.contiguous_strides(shape)
            if kv_interior == "NHD":
                strides = (shape[2], shape[0] * shape[2], 1)
            elif kv_interior != "HND":
                raise ValueError(f"kv_interior {kv_interior!r} not HND or NHD")
            layers.append(L.AttentionLayout(i, kv_dtype, shape, strides, kv_format=kv_format))
        else:
            cshape = (w, cfg.conv_dim) if conv_layout == "SD" else (cfg.conv_dim, w)
            rshape = (h, dv, dk) if rec_layout == "HVK" else (h, dk, dv)
            layers.append(L.GDNLayout(i, conv_layout, conv_dtype, cshape, L.contiguous_strides(cshape),
                                      rec_layout, rec_dtype, rshape, L.contiguous_strides(rshape)))
    return L.Layout(model=L.model_identity(cfg), block_size=block_size, layers=tuple(layers))


def pack_state(state: Mapping[str, torch.Tensor], seq_len: int, layout: L.Layout, *, seed: int = 0,
               spare_blocks: int = 3) -> tuple[torch.Tensor, dict[int, list[int]]]:
    """Native state -> a vLLM-like unified paged cache (1-D uint8) and, per layer, the byte offsets of
    its pages in sequence order. Pages sit at shuffled block ids with a padded common page stride,
    the way vLLM's hybrid allocator lays them out, so the sender really gathers scattered pages.
    """
    n_pages = math.ceil(seq_len / layout.block_size)
    stride = P.align_up(max(layer.page_bytes for layer in layout.layers) + 64)
    need = sum(n_pages if layer.kind == "attention" else 1 for layer in layout.layers) + spare_blocks
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(need, generator=g).tolist()
    cache = torch.zeros(need * stride, dtype=torch.uint8)
    pages: dict[int, list[int]] = {}
    for layer in layout.layers:
        i = layer.index
        if layer.kind == "attention":
            h, bs, d2 = layer.shape
            kv = torch.zeros(h, n_pages * bs, d2, dtype=TORCH_DTYPES[layer.dtype])
            native = AttentionState.from_named(state, i)
            kv[:, :seq_len, : d2 // 2] = native.k[:, :seq_len]
            kv[:, :seq_len, d2 // 2:] = native.v[:, :seq_len]
            paged = kv.reshape(h, n_pages, bs, d2).permute(1, 0, 2, 3)  # (pages, h, bs, 2d)
            d = d2 // 2
            if layer.kv_format == "cpu_vec":  # per head: K^T (d, bs) then V (bs, d), flat
                paged = torch.cat([paged[..., :d].transpose(2, 3).reshape(n_pages, h, -1),
                                   paged[..., d:].reshape(n_pages, h, -1)], dim=2).reshape(n_pages, h, bs, d2)
            elif layer.kv_format == "cpu_amx":  # per head: K (bs/16, d/2, 16, 2) then V (d/16, bs/2, 16, 2)
                k = paged[..., :d].reshape(n_pages, h, bs // 16, 16, d // 2, 2).permute(0, 1, 2, 4, 3, 5)
                v = paged[..., d:].reshape(n_pages, h, bs // 2, 2, d // 16, 16).permute(0, 1, 4, 2, 5, 3)
                paged = torch.cat([k.reshape(n_pages, h, -1), v.reshape(n_pages, h, -1)],
                                  dim=2).reshape(n_pages, h, bs, d2)
            offs = []
            for p in range(n_pages):
                off = blocks.pop() * stride
                _write_strided(cache, off, paged[p], layer.dtype, layer.strides)
                offs.append(off)
            pages[i] = offs
        else:
            native = GDNState.from_named(state, i)
            conv, rec = native.conv, native.rec  # [conv_dim, kernel-1], [heads, dk, dv]
            off = blocks.pop() * stride
            _write_strided(cache, off, conv.t() if layer.conv_layout == "SD" else conv, layer.conv_dtype,
                           layer.conv_strides)
            _write_strided(cache, off + layer.rec_start, rec.transpose(1, 2) if layer.rec_layout == "HVK" else rec,
                           layer.rec_dtype, layer.rec_strides)
            pages[i] = [off]
    return cache, pages


def _write_strided(cache: torch.Tensor, off: int, src: torch.Tensor, dtype: str, strides) -> None:
    span = L.span_elems(tuple(src.shape), tuple(strides))
    dst = cache[off: off + span * L.DTYPE_SIZES[dtype]].view(TORCH_DTYPES[dtype])
    torch.as_strided(dst, tuple(src.shape), tuple(strides)).copy_(src.to(TORCH_DTYPES[dtype]))
