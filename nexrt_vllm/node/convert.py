"""Layout descriptors for a model, validation of a sender's layout, and the conversion between the
sender's paged layout and the engine's native state (docs/ARCHITECTURE.md §1 and §3).

``unpack_state`` is what the decode node runs on every hand-off: received bytes -> native tensors,
including dtype changes, conv ``SD``/``DS`` and recurrent ``HVK``/``HKV`` orientation.
``pack_state`` is its inverse (native -> vLLM-like pages scattered over a unified cache); the tests
and the hand-off benchmark use it to play the prefill side.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from nexrt_vllm.engine.dtypes import TORCH_DTYPES
from nexrt_vllm.engine.dtypes import contiguous_strides as _contig
from nexrt_vllm.engine.state import AttentionState, GDNState
from nexrt_vllm.handoff import protocol as P


def model_identity(cfg) -> dict:
    """The fields a layout's ``model`` map must match (engine ModelConfig); ``architecture`` is the
    HF ``architectures[0]``. Only ``num_hidden_layers`` is mandatory; any other field given must match."""
    return {"architecture": cfg.architecture, "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size}


def layout_for(cfg, *, block_size: int = 16, kv_dtype: str = "bfloat16", conv_dtype: str = "bfloat16",
               rec_dtype: str = "float32", conv_layout: str = "SD", rec_layout: str = "HVK",
               kv_format: str = "packed", kv_interior: str = "HND") -> P.Layout:
    """The descriptor of vLLM-like pages for ``cfg`` (sender-side choices as arguments).
    ``kv_interior``: ``"HND"`` heads outside tokens (vLLM's LBHNC, CPU), ``"NHD"`` tokens outside
    heads (LBNHC, FlashAttention's default on GPUs)."""
    layers: list[P.LayerLayout] = []
    w = cfg.conv_kernel - 1
    h, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for i, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            shape = (cfg.num_kv_heads, block_size, 2 * cfg.head_dim)
            strides = _contig(shape)
            if kv_interior == "NHD":
                strides = (shape[2], shape[0] * shape[2], 1)
            elif kv_interior != "HND":
                raise ValueError(f"kv_interior {kv_interior!r} not HND or NHD")
            layers.append(P.AttentionLayout(i, kv_dtype, shape, strides, kv_format=kv_format))
        else:
            cshape = (w, cfg.conv_dim) if conv_layout == "SD" else (cfg.conv_dim, w)
            rshape = (h, dv, dk) if rec_layout == "HVK" else (h, dk, dv)
            layers.append(P.GDNLayout(i, conv_layout, conv_dtype, cshape, _contig(cshape),
                                      rec_layout, rec_dtype, rshape, _contig(rshape)))
    return P.Layout(model=model_identity(cfg), block_size=block_size, layers=tuple(layers))


def check_layout(layout: P.Layout, cfg) -> None:
    """Raise ProtocolError(LAYOUT_MISMATCH) unless ``layout`` describes ``cfg``'s state exactly."""
    def bad(msg):
        raise P.ProtocolError(P.Reason.LAYOUT_MISMATCH, msg)

    ident = model_identity(cfg)
    for k, want in ident.items():
        if k in layout.model and layout.model[k] != want:
            bad(f"model {k}={layout.model[k]!r}, node serves {want!r}")
    if "num_hidden_layers" not in layout.model:
        bad("layout.model lacks num_hidden_layers")
    got = sorted(layer.index for layer in layout.layers)
    if got != list(range(cfg.num_layers)):
        bad(f"layout covers layers {got}, node needs 0..{cfg.num_layers - 1}")
    for layer in layout.layers:
        kind = cfg.layer_types[layer.index]
        if kind == "full_attention":
            if layer.kind != "attention":
                bad(f"layer {layer.index}: node has full attention, sender says {layer.kind}")
            want = (cfg.num_kv_heads, layout.block_size, 2 * cfg.head_dim)
            if tuple(layer.shape) != want:
                bad(f"layer {layer.index}: page shape {tuple(layer.shape)}, expected {want}")
        else:
            if layer.kind != "gdn":
                bad(f"layer {layer.index}: node has GDN, sender says {layer.kind}")
            if (layer.conv_dim, layer.conv_width) != (cfg.conv_dim, cfg.conv_kernel - 1):
                bad(f"layer {layer.index}: conv (dim, width) {(layer.conv_dim, layer.conv_width)}, "
                    f"expected {(cfg.conv_dim, cfg.conv_kernel - 1)}")
            want = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            if layer.rec_dims != want:
                bad(f"layer {layer.index}: recurrent (heads, dk, dv) {layer.rec_dims}, expected {want}")


def native_bytes(cfg, seq_len: int, kv_bytes: int, conv_bytes: int, rec_bytes: int = 4) -> int:
    """Receive-buffer bytes for ``seq_len`` tokens with the given element sizes (alignment included)."""
    attn = cfg.num_kv_heads * 2 * cfg.head_dim * kv_bytes * seq_len
    gdn = (cfg.conv_dim * (cfg.conv_kernel - 1) * conv_bytes
           + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * rec_bytes)
    return (len(cfg.attention_layers) * attn + len(cfg.gdn_layers) * gdn + cfg.num_layers * P.REGION_ALIGN)


def unpack_state(buf: torch.Tensor, layout: P.Layout, regions: list[P.Region], seq_len: int,
                 dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Received bytes (1-D uint8 tensor holding every region) -> engine-native state tensors.

    ``dtypes`` gives the native dtypes: ``{"kv": ..., "conv": ..., "rec": ...}``. Attention K/V come
    out as ``[kv_heads, seq_len, head_dim]``, conv ``[conv_dim, kernel-1]``, recurrent
    ``[heads, dk, dv]``; all contiguous, on ``buf``'s device.
    """
    out: dict[str, torch.Tensor] = {}
    for layer, reg in zip(layout.layers, regions):
        raw = buf[reg.offset: reg.offset + reg.nbytes]
        if layer.kind == "attention":
            k, v = _attention_kv(raw, layer, reg)
            out.update(AttentionState(k=k[:, :seq_len].to(dtypes["kv"]).contiguous(),
                                      v=v[:, :seq_len].to(dtypes["kv"]).contiguous()).named(layer.index))
        else:
            conv = torch.as_strided(raw[:layer.conv_bytes].view(TORCH_DTYPES[layer.conv_dtype]),
                                    layer.conv_shape, layer.conv_strides)
            if layer.conv_layout == "SD":
                conv = conv.t()
            rec = torch.as_strided(raw[layer.conv_bytes: layer.page_bytes].view(TORCH_DTYPES[layer.rec_dtype]),
                                   layer.rec_shape, layer.rec_strides)
            if layer.rec_layout == "HVK":
                rec = rec.transpose(1, 2)
            out.update(GDNState(conv=conv.to(dtypes["conv"]).contiguous(),
                                rec=rec.to(dtypes["rec"]).contiguous()).named(layer.index))
    return out


def _attention_kv(raw: torch.Tensor, layer: P.AttentionLayout, reg: P.Region):
    """A layer's received pages -> (K, V) as ``[kv_heads, pages*block_size, head_dim]`` views."""
    h, bs, d2 = layer.shape
    d = d2 // 2
    elems = raw.view(TORCH_DTYPES[layer.dtype])
    page = reg.page_bytes // P.DTYPE_SIZES[layer.dtype]
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


def pack_state(state: Mapping[str, torch.Tensor], seq_len: int, layout: P.Layout, *, seed: int = 0,
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
            _write_strided(cache, off + layer.conv_bytes, rec.transpose(1, 2) if layer.rec_layout == "HVK" else rec,
                           layer.rec_dtype, layer.rec_strides)
            pages[i] = [off]
    return cache, pages


def _write_strided(cache: torch.Tensor, off: int, src: torch.Tensor, dtype: str, strides) -> None:
    span = P.span_elems(tuple(src.shape), tuple(strides))
    dst = cache[off: off + span * P.DTYPE_SIZES[dtype]].view(TORCH_DTYPES[dtype])
    torch.as_strided(dst, tuple(src.shape), tuple(strides)).copy_(src.to(TORCH_DTYPES[dtype]))
