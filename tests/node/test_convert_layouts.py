"""Received pages in every sender layout -> engine-native state (dtype, conv SD/DS, recurrent
HVK/HKV, packed and vLLM-CPU attention interiors); layouts of another model are refused."""
import itertools

import pytest
import torch

from nexrt_vllm.engine.state import AttentionState, GDNState
from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.node.convert import unpack_state
from nexrt_vllm.testing.senders import layout_for, pack_state


@pytest.fixture(scope="module")
def cfg(qwen3_next_ckpt):
    from nexrt_vllm.engine import ModelConfig
    return ModelConfig.from_pretrained(qwen3_next_ckpt)


def _state(cfg, seq_len, g):
    out = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            k, v = (torch.randn(cfg.num_kv_heads, seq_len, cfg.head_dim, generator=g).bfloat16() for _ in "kv")
            out.update(AttentionState(k=k, v=v).named(i))
        else:
            conv = torch.randn(cfg.conv_dim, cfg.conv_kernel - 1, generator=g).bfloat16()
            rec = torch.randn(cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                              generator=g)
            out.update(GDNState(conv=conv, rec=rec).named(i))
    return out


NATIVE = {"kv": torch.bfloat16, "conv": torch.bfloat16, "rec": torch.float32}


@pytest.mark.parametrize("conv,rec,rec_dtype,kv_format,kv_dtype", list(itertools.product(
    ["SD", "DS"], ["HVK", "HKV"], ["float32", "bfloat16"], ["packed", "packed_nhd", "cpu_vec"],
    ["bfloat16", "float32"])))
def test_round_trip_every_layout(cfg, conv, rec, rec_dtype, kv_format, kv_dtype):
    seq_len = 37  # 3 pages of 16, the last one partial
    state = _state(cfg, seq_len, torch.Generator().manual_seed(1))
    interior = "NHD" if kv_format == "packed_nhd" else "HND"  # NHD: FlashAttention's LBNHC pages
    lay = layout_for(cfg, block_size=16, conv_layout=conv, rec_layout=rec, rec_dtype=rec_dtype,
                     kv_format=kv_format.removesuffix("_nhd"), kv_dtype=kv_dtype, kv_interior=interior)
    cache, pages = pack_state(state, seq_len, lay)
    regions = lay.regions(seq_len)
    buf = torch.zeros(regions[-1].offset + regions[-1].nbytes, dtype=torch.uint8)
    for reg in regions:  # what the transport does: page i -> offset + i*page_bytes
        for i, src in enumerate(pages[reg.layer]):
            dst = reg.offset + i * reg.page_bytes
            buf[dst: dst + reg.page_bytes] = cache[src: src + reg.page_bytes]
    got = unpack_state(buf, lay, regions, seq_len, NATIVE)
    assert set(got) == set(state)
    for name, want in state.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        if name.endswith(".rec") and rec_dtype == "bfloat16":
            want = want.bfloat16().float()  # the sender rounded it
        assert torch.equal(got[name], want), name


def test_hand_built_vllm_pages_convert_to_native(cfg):
    """Independent of pack_state: vLLM-shaped tensors indexed by hand."""
    bs, seq_len = 4, 6
    lay = layout_for(cfg, block_size=bs, conv_layout="SD", rec_layout="HVK", rec_dtype="float32")
    attn = next(layer for layer in lay.layers if layer.kind == "attention")
    gdn = next(layer for layer in lay.layers if layer.kind == "gdn")
    h, d = cfg.num_kv_heads, cfg.head_dim
    g = torch.Generator().manual_seed(2)
    kv_cache = torch.randn(5, h, bs, 2 * d, generator=g).bfloat16()  # (num_blocks, heads, bs, 2*hd)
    block_ids = [3, 1]  # tokens 0-3 in block 3, tokens 4-5 in block 1
    conv_sd = torch.randn(cfg.conv_kernel - 1, cfg.conv_dim, generator=g).bfloat16()
    rec_hvk = torch.randn(cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim,
                          generator=g)
    regions = {r.layer: r for r in lay.regions(seq_len)}
    buf = torch.zeros(max(r.offset + r.nbytes for r in regions.values()), dtype=torch.uint8)
    ra = regions[attn.index]
    for i, b in enumerate(block_ids):
        buf[ra.offset + i * ra.page_bytes: ra.offset + (i + 1) * ra.page_bytes] = kv_cache[b].reshape(-1).view(torch.uint8)
    rg = regions[gdn.index]
    page = torch.cat([conv_sd.reshape(-1).view(torch.uint8), rec_hvk.reshape(-1).view(torch.uint8)])
    buf[rg.offset: rg.offset + rg.nbytes] = page
    got = unpack_state(buf, L.Layout(lay.model, bs, (attn, gdn)), [ra, rg], seq_len, NATIVE)
    native = AttentionState.from_named(got, attn.index)
    k, v = native.k, native.v
    for t in range(seq_len):
        blk = kv_cache[block_ids[t // bs]]
        assert torch.equal(k[:, t], blk[:, t % bs, :d]) and torch.equal(v[:, t], blk[:, t % bs, d:])
    native = GDNState.from_named(got, gdn.index)
    assert torch.equal(native.conv, conv_sd.t())
    assert torch.equal(native.rec[2, 5, 7], rec_hvk[2, 7, 5])


def test_cpu_vec_page_interior(cfg):
    """vLLM-CPU vec ISA: per head K^T (head_dim, block) then V (block, head_dim)."""
    bs, seq_len = 4, 4
    lay = layout_for(cfg, block_size=bs, kv_format="cpu_vec")
    attn = next(layer for layer in lay.layers if layer.kind == "attention")
    h, d = cfg.num_kv_heads, cfg.head_dim
    kt = torch.randn(h, d, bs).bfloat16()
    v = torch.randn(h, bs, d).bfloat16()
    page = torch.cat([kt.reshape(h, -1), v.reshape(h, -1)], dim=1)
    reg = lay.regions(seq_len)[attn.index]
    buf = torch.zeros(reg.offset + reg.nbytes, dtype=torch.uint8)
    buf[reg.offset:] = page.reshape(-1).view(torch.uint8)
    got = unpack_state(buf, L.Layout(lay.model, bs, (attn,)), [reg], seq_len, NATIVE)
    native = AttentionState.from_named(got, attn.index)
    assert torch.equal(native.k, kt.transpose(1, 2))
    assert torch.equal(native.v, v)


def test_layout_of_another_model_is_refused(cfg, qwen3_5_ckpt):
    from nexrt_vllm.engine import ModelConfig
    L.check_layout(layout_for(cfg), cfg)
    other = ModelConfig.from_pretrained(qwen3_5_ckpt)
    with pytest.raises(P.ProtocolError) as ei:
        L.check_layout(layout_for(other), cfg)
    assert ei.value.reason is P.Reason.LAYOUT_MISMATCH
    lay = layout_for(cfg)
    swapped = tuple(L.AttentionLayout(x.index, "bfloat16", (cfg.num_kv_heads, 16, 2 * cfg.head_dim),
                                      (32 * cfg.head_dim, 2 * cfg.head_dim, 1)) if x.kind == "gdn" else x
                    for x in lay.layers)
    with pytest.raises(P.ProtocolError, match="node has GDN"):
        L.check_layout(L.Layout(lay.model, 16, swapped), cfg)
    with pytest.raises(P.ProtocolError, match="covers layers"):
        L.check_layout(L.Layout(lay.model, 16, lay.layers[1:]), cfg)


def test_mtp_drafter_layers(cfg):
    """Layout version 4: the MTP drafter's attention (a speculating prefill vLLM) is layer
    num_layers + i; taken when shaped as the target's attention, refused otherwise or past the
    checkpoint's MTP layers (this one has none: any count is taken and the layers dropped)."""
    import dataclasses

    lay = layout_for(cfg)
    a = next(x for x in lay.layers if x.kind == "attention")
    n = cfg.num_layers
    with_drafter = L.Layout(lay.model, lay.block_size, lay.layers + (dataclasses.replace(a, index=n),))
    L.check_layout(with_drafter, cfg)
    assert [x.index for x in L.drafter_layers(with_drafter, n)] == [n]
    wide = dataclasses.replace(a, index=n, shape=(a.shape[0] + 1,) + tuple(a.shape[1:]))
    with pytest.raises(P.ProtocolError, match=f"layer {n} \\(MTP layer 0\\): attention page"):
        L.check_layout(L.Layout(lay.model, lay.block_size, lay.layers + (wide,)), cfg)
    one = dataclasses.replace(cfg, mtp_num_layers=1)
    L.check_layout(with_drafter, one)
    with pytest.raises(P.ProtocolError, match="MTP layer 1, the node's checkpoint has 1"):
        L.check_layout(L.Layout(lay.model, lay.block_size, with_drafter.layers + (dataclasses.replace(a, index=n + 1),)),
                       one)
