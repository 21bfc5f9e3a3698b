"""The node's conversion of received pages into the engine's native state (docs/ARCHITECTURE.md
§1 and §3), run on every hand-off: received bytes -> native tensors, including dtype changes,
conv ``SD``/``DS`` and recurrent ``HVK``/``HKV`` orientation. The layout descriptor and its
validation are ``nexrt_vllm.handoff.layout``; the inverse (native -> vLLM-like pages), which tests
and the hand-off benchmark use to play the prefill side, is ``nexrt_vllm.testing.senders``.
"""
from __future__ import annotations

from typing import Mapping

import torch

from nexrt_vllm.engine.dtypes import TORCH_DTYPES
from nexrt_vllm.engine.state import AttentionState, GDNState
from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P


def native_bytes(cfg, seq_len: int, kv_bytes: int, conv_bytes: int, rec_bytes: int = 4) -> int:
    """Receive-buffer bytes for ``seq_len`` tokens with the given element sizes (alignment included)."""
    attn = cfg.num_kv_heads * 2 * cfg.head_dim * kv_bytes * seq_len
    gdn = (cfg.conv_dim * (cfg.conv_kernel - 1) * conv_bytes
           + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * rec_bytes)
    return (len(cfg.attention_layers) * attn + len(cfg.gdn_layers) * gdn + cfg.num_layers * P.REGION_ALIGN)


def unpack_state(buf: torch.Tensor, layout: L.Layout, regions: list[P.Region], seq_len: int,
                 dtypes: Mapping[str, torch.dtype], held: int = 0) -> dict[str, torch.Tensor]:
    """Received bytes (1-D uint8 tensor holding every region) -> engine-native state tensors.

    ``dtypes`` gives the native dtypes: ``{"kv": ..., "conv": ..., "rec": ...}``. Attention K/V come
    out as ``[kv_heads, seq_len, head_dim]``, conv ``[conv_dim, kernel-1]``, recurrent
    ``[heads, dk, dv]``; all contiguous, on ``buf``'s device. With ``held`` leading tokens held by
    the node (``Layout.first_page``), the model's attention layers received only the rows from
    ``held`` on: their K/V are ``[kv_heads, seq_len - held, head_dim]``.
    """
    out: dict[str, torch.Tensor] = {}
    for layer, reg in zip(layout.layers, regions):
        raw = buf[reg.offset: reg.offset + reg.nbytes]
        if layer.kind == "attention":
            k, v = _attention_kv(raw, layer, reg)
            n = seq_len - layout.first_page(layer, held) * layout.block_size
            out.update(AttentionState(k=k[:, :n].to(dtypes["kv"]).contiguous(),
                                      v=v[:, :n].to(dtypes["kv"]).contiguous()).named(layer.index))
        else:
            conv = torch.as_strided(raw[:layer.conv_bytes].view(TORCH_DTYPES[layer.conv_dtype]),
                                    layer.conv_shape, layer.conv_strides)
            if layer.conv_layout == "SD":
                conv = conv.t()
            rec = torch.as_strided(raw[layer.rec_start: layer.page_bytes].view(TORCH_DTYPES[layer.rec_dtype]),
                                   layer.rec_shape, layer.rec_strides)
            if layer.rec_layout == "HVK":
                rec = rec.transpose(1, 2)
            out.update(GDNState(conv=conv.to(dtypes["conv"]).contiguous(),
                                rec=rec.to(dtypes["rec"]).contiguous()).named(layer.index))
    return out


def _attention_kv(raw: torch.Tensor, layer: L.AttentionLayout, reg: P.Region):
    """A layer's received pages -> (K, V) as ``[kv_heads, pages*block_size, head_dim]`` views."""
    h, bs, d2 = layer.shape
    d = d2 // 2
    if reg.num_pages == 0:  # every row held by the node's context cache
        empty = torch.empty(h, 0, d, dtype=TORCH_DTYPES[layer.dtype], device=raw.device)
        return empty, empty
    elems = raw.view(TORCH_DTYPES[layer.dtype])
    page = reg.page_bytes // L.DTYPE_SIZES[layer.dtype]
    if layer.kv_format == "packed":
        pages = torch.as_strided(elems, (reg.num_pages, h, bs, d2), (page, *layer.strides))
        kv = pages.permute(1, 0, 2, 3).reshape(h, reg.num_pages * bs, d2)
        return kv[..., :d], kv[..., d:]
    heads = torch.as_strided(elems, (reg.num_pages, h, 2 * bs * d), (page, layer.strides[0], 1))
    n = reg.num_pages
    if layer.kv_format == "cpu_amx":  # K (bs/16, d/2, 16, 2), V (d/16, bs/2, 16, 2) per head
        k = heads[..., : bs * d].reshape(n, h, bs // 16, d // 2, 16, 2).permute(1, 0, 2, 4, 3, 5).reshape(h, -1, d)
        v = heads[..., bs * d:].reshape(n, h, d // 16, bs // 2, 16, 2).permute(1, 0, 3, 5, 2, 4).reshape(h, -1, d)
        return k, v
    # cpu_vec: per head, K transposed (head_dim, block_size) then V (block_size, head_dim)
    k = heads[..., : bs * d].reshape(n, h, d, bs).permute(1, 0, 3, 2).reshape(h, -1, d)
    v = heads[..., bs * d:].reshape(n, h, bs, d).permute(1, 0, 2, 3).reshape(h, -1, d)
    return k, v
