"""The layout descriptor: how the sender's pages of one request are laid out, layer by layer,
so the node can validate them against its model and convert them (``nexrt_vllm.node.convert``).
Hello and begin carry it (``Layout.to_wire()``); ``Layout.regions`` plans where the pages go in
the node's receive buffer.

* attention layer: one page per ``block_size`` tokens, page tensor ``(kv_heads, block_size,
  2*head_dim)``; ``strides`` are element strides inside a page. ``kv_format`` says how K and V sit
  inside each head's ``block_size*2*head_dim`` elements (added by the connector; see
  docs/CONNECTOR.md, "Attention page interior"):
  ``"packed"``: token-major, K|V packed on the last dim (``strides`` apply);
  ``"cpu_vec"``: vLLM's CPU backend, ISA vec/vec16: K as ``(head_dim, block_size)`` (transposed)
  then V as ``(block_size, head_dim)``, both contiguous (vLLM views the page as
  ``(kv_heads, 2*block_size, head_dim)`` and chunks dim 1; the K half is written transposed);
  ``"cpu_amx"``: vLLM's CPU backend, ISA amx (bf16): K as ``(block_size/16, head_dim/2, 16, 2)``
  (token tiles of 16, dim pairs) then V as ``(head_dim/16, block_size/2, 16, 2)`` (dim tiles of 16,
  token pairs), i.e. element (t, d) of K at ``((t//16)*(D/2) + d//2)*32 + (t%16)*2 + d%2``.
* GDN layer: one page = conv bytes then recurrent ("temporal") bytes. Conv ``"SD"`` is
  ``(kernel-1, conv_dim)``, ``"DS"`` is ``(conv_dim, kernel-1)``; recurrent ``"HVK"`` is
  ``(v_heads, head_v_dim, head_k_dim)``, ``"HKV"`` is ``(v_heads, head_k_dim, head_v_dim)``.
  ``rec_offset`` (version 3, optional): where the recurrent bytes start when the conv allocation is
  wider than the conv state it holds (vLLM with speculative decoding: its first kernel-1
  positions; ``conv_strides`` step over the whole width); 0 means right after ``conv_shape``.
* ``sharding`` (version 2, optional): the part of a TP = N prefill this layout describes, as the
  global head ranges it holds (``nexrt_vllm.handoff.sharding``); its pages have that part's head
  counts, and a part without KV heads (a replica's) lists no attention layer.

Dtypes are named by the strings of ``DTYPE_SIZES`` (torch's attribute names; the torch mapping
is ``nexrt_vllm.engine.dtypes.TORCH_DTYPES``). Pure Python, like the rest of ``nexrt_vllm.handoff``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from nexrt_vllm.handoff.protocol import ProtocolError, Reason, Region, align_up
from nexrt_vllm.handoff.sharding import Sharding

# Versions: 1 the unsharded descriptor; 2 adds ``sharding`` (a TP part: which heads it holds;
# done/abort name the part); 3 adds the GDN ``rec_offset``; 4 adds the MTP drafter's attention
# layers (index num_hidden_layers + i for MTP layer i; `drafter_layers`). A node takes every earlier
# version (an absent field is its default); an older node refuses a newer layout at hello.
LAYOUT_VERSION = 4
LAYOUT_VERSIONS = (1, 2, 3, 4)

# Bytes per element of every dtype a layout may name.
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1, "uint8": 1}
# The page dtypes a node converts into its state (a plain cast). Quantized pages (vLLM's
# --kv-cache-dtype fp8 and friends) hold x / scale with per-layer k / v scales the layout does not
# carry, so a node refuses them at hello rather than decode from misread values.
STATE_PAGE_DTYPES = ("float32", "bfloat16", "float16")
CONV_LAYOUTS = ("SD", "DS")
KV_FORMATS = ("packed", "cpu_vec", "cpu_amx")
REC_LAYOUTS = ("HVK", "HKV")


@dataclass(frozen=True)
class AttentionLayout:
    """One full-attention layer's pages: ``(kv_heads, block_size, 2*head_dim)``, K|V packed."""

    index: int  # model layer index
    dtype: str
    shape: tuple[int, int, int]
    strides: tuple[int, int, int]  # element strides inside one page
    kind: str = "attention"
    kv_format: str = "packed"  # one of KV_FORMATS

    @property
    def kv_heads(self) -> int:
        return self.shape[0]

    @property
    def head_dim(self) -> int:
        return self.shape[2] // 2

    @property
    def page_bytes(self) -> int:
        return span_elems(self.shape, self.strides) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class GDNLayout:
    """One GDN layer's state page: conv bytes, then recurrent bytes."""

    index: int
    conv_layout: str  # "SD" (kernel-1, conv_dim) | "DS" (conv_dim, kernel-1)
    conv_dtype: str
    conv_shape: tuple[int, int]
    conv_strides: tuple[int, int]
    rec_layout: str  # "HVK" (heads, dv, dk) | "HKV" (heads, dk, dv)
    rec_dtype: str
    rec_shape: tuple[int, int, int]
    rec_strides: tuple[int, int, int]
    kind: str = "gdn"
    # Byte offset of the recurrent state in the page; 0: right after the conv state. A conv state
    # allocated wider than kernel-1 (vLLM with speculative decoding) holds the state in its first
    # kernel-1 positions, and the recurrent state starts after the whole allocation.
    rec_offset: int = 0

    @property
    def conv_bytes(self) -> int:
        return span_elems(self.conv_shape, self.conv_strides) * DTYPE_SIZES[self.conv_dtype]

    @property
    def rec_bytes(self) -> int:
        return span_elems(self.rec_shape, self.rec_strides) * DTYPE_SIZES[self.rec_dtype]

    @property
    def rec_start(self) -> int:
        return self.rec_offset or self.conv_bytes

    @property
    def page_bytes(self) -> int:
        return self.rec_start + self.rec_bytes

    @property
    def conv_dim(self) -> int:
        return self.conv_shape[1] if self.conv_layout == "SD" else self.conv_shape[0]

    @property
    def conv_width(self) -> int:  # kernel - 1
        return self.conv_shape[0] if self.conv_layout == "SD" else self.conv_shape[1]

    @property
    def rec_dims(self) -> tuple[int, int, int]:
        """(v_heads, head_k_dim, head_v_dim) whatever the orientation."""
        h, a, b = self.rec_shape
        return (h, b, a) if self.rec_layout == "HVK" else (h, a, b)


LayerLayout = AttentionLayout | GDNLayout


@dataclass(frozen=True)
class Layout:
    """What the sender ships, layer by layer in model order (only layers that carry state)."""

    model: dict[str, Any]  # {"num_hidden_layers", "hidden_size", "vocab_size", ...} identity
    block_size: int  # tokens per attention page
    layers: tuple[LayerLayout, ...]
    version: int = LAYOUT_VERSION
    sharding: Sharding | None = None  # the heads of a TP part (handoff/sharding.py); None: the whole state

    def to_wire(self) -> dict:
        d = {"version": self.version, "model": dict(self.model), "block_size": self.block_size,
             "layers": [_layer_to_wire(layer) for layer in self.layers]}
        if self.sharding is not None:
            d["sharding"] = self.sharding.to_wire()
        return d

    @classmethod
    def from_wire(cls, d: Any) -> "Layout":
        """Parse and structurally validate a wire layout; raises ProtocolError."""
        if not isinstance(d, dict):
            raise ProtocolError(Reason.BAD_MESSAGE, "layout must be a map")
        version = d.get("version")
        if version not in LAYOUT_VERSIONS or isinstance(version, bool):
            raise ProtocolError(Reason.LAYOUT_VERSION,
                                f"layout version {version!r} unsupported (node speaks {list(LAYOUT_VERSIONS)})")
        try:
            block_size = int(d["block_size"])
            model = dict(d["model"])
            layers = tuple(_layer_from_wire(x) for x in d["layers"])
            sharding = Sharding.from_wire(d["sharding"]) if d.get("sharding") is not None else None
        except ProtocolError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(Reason.BAD_MESSAGE, f"malformed layout: {e!r}") from None
        if block_size <= 0:
            raise ProtocolError(Reason.BAD_MESSAGE, "layout block_size must be positive")
        idx = [layer.index for layer in layers]
        if len(set(idx)) != len(idx):
            raise ProtocolError(Reason.BAD_MESSAGE, "layout names a layer twice")
        if sharding is not None and version < 2:
            raise ProtocolError(Reason.BAD_MESSAGE, "layout version 1 carries no sharding")
        return cls(model=model, block_size=block_size, layers=layers, sharding=sharding)

    def regions(self, seq_len: int, base: int = 0, held: int = 0) -> list["Region"]:
        """Where each layer's pages go in the receive buffer for a ``seq_len``-token request
        (from offset ``base``: where a TP part's share of the buffer starts) whose first ``held``
        tokens the node holds already (``first_page``: the pages that stay home)."""
        self.check_held(held, seq_len)
        out, off = [], align_up(base)
        pages = math.ceil(seq_len / self.block_size)
        for layer in self.layers:
            n = pages - self.first_page(layer, held) if layer.kind == "attention" else 1
            out.append(Region(layer=layer.index, kind=layer.kind, offset=off,
                              page_bytes=layer.page_bytes, num_pages=n))
            off = align_up(off + n * layer.page_bytes)
        return out

    def first_page(self, layer: LayerLayout, held: int) -> int:
        """The first page of ``layer`` that travels when the node holds ``held`` leading tokens: the
        model's attention layers skip ``held / block_size`` pages (the node's context cache holds
        their rows); GDN state and the MTP drafter's layers (version 4) always travel whole."""
        if layer.kind != "attention" or layer.index >= self.model.get("num_hidden_layers", 0):
            return 0
        return held // self.block_size

    def check_held(self, held: int, seq_len: int) -> None:
        """ProtocolError(BAD_MESSAGE) unless ``held`` is whole pages within the prompt."""
        if held and (held < 0 or held > seq_len or held % self.block_size):
            raise ProtocolError(Reason.BAD_MESSAGE, f"held_tokens {held} is not whole {self.block_size}-token "
                                                    f"pages within seq_len {seq_len}")


def span_elems(shape, strides) -> int:
    """Elements spanned by a strided tensor (max offset + 1); 0 for an empty one."""
    if any(s <= 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, strides))


def contiguous_strides(shape) -> tuple[int, ...]:
    """Element strides of a row-major contiguous tensor of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def model_identity(cfg) -> dict:
    """The fields a layout's ``model`` map must match (engine ModelConfig); ``architecture`` is the
    HF ``architectures[0]``. Only ``num_hidden_layers`` is mandatory; any other field given must match."""
    return {"architecture": cfg.architecture, "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size}


def check_dtypes(layout: Layout) -> None:
    """Raise ProtocolError(LAYOUT_MISMATCH) for pages in a dtype the node cannot cast into its state:
    a quantized KV cache (vLLM ``--kv-cache-dtype fp8``: e4m3 pages with scales the layout does not
    carry) or a quantized GDN state."""
    take = "/".join(STATE_PAGE_DTYPES)
    for layer in layout.layers:
        if layer.kind == "attention" and layer.dtype not in STATE_PAGE_DTYPES:
            raise ProtocolError(Reason.LAYOUT_MISMATCH, (
                f"layer {layer.index}: KV cache pages in {layer.dtype} (vLLM kv_cache_dtype fp8 / --kv-cache-dtype); "
                f"NexRT nodes take {take} KV pages and do not dequantize KV caches: start vLLM with "
                f"--kv-cache-dtype auto"))
        if layer.kind == "gdn":
            for what, dt in (("conv", layer.conv_dtype), ("recurrent", layer.rec_dtype)):
                if dt not in STATE_PAGE_DTYPES:
                    raise ProtocolError(Reason.LAYOUT_MISMATCH, (
                        f"layer {layer.index}: GDN {what} state pages in {dt} (vLLM mamba_cache_dtype); NexRT "
                        f"nodes take {take}"))


def check_layout(layout: Layout, cfg) -> None:
    """Raise ProtocolError(LAYOUT_MISMATCH) unless ``layout`` describes ``cfg``'s state exactly."""
    def bad(msg):
        raise ProtocolError(Reason.LAYOUT_MISMATCH, msg)

    check_dtypes(layout)
    ident = model_identity(cfg)
    for k, want in ident.items():
        if k in layout.model and layout.model[k] != want:
            bad(f"model {k}={layout.model[k]!r}, node serves {want!r}")
    if "num_hidden_layers" not in layout.model:
        bad("layout.model lacks num_hidden_layers")
    got = sorted(layer.index for layer in layout.layers if layer.index < cfg.num_layers)
    if got != list(range(cfg.num_layers)):
        bad(f"layout covers layers {got}, node needs 0..{cfg.num_layers - 1}")
    page = (cfg.num_kv_heads, layout.block_size, 2 * cfg.head_dim)  # every attention layer's
    for layer in layout.layers:
        if layer.index >= cfg.num_layers:
            # the MTP drafter's own KV (a speculating prefill vLLM): its attention has the target's heads
            i = layer.index - cfg.num_layers
            if cfg.mtp_num_layers and i >= cfg.mtp_num_layers:
                bad(f"layer {layer.index}: MTP layer {i}, the node's checkpoint has {cfg.mtp_num_layers}")
            if layer.kind != "attention" or tuple(layer.shape) != page:
                bad(f"layer {layer.index} (MTP layer {i}): {layer.kind} page {tuple(getattr(layer, 'shape', ()))}, "
                    f"expected attention {page}")
            continue
        kind = cfg.layer_types[layer.index]
        if kind == "full_attention":
            if layer.kind != "attention":
                bad(f"layer {layer.index}: node has full attention, sender says {layer.kind}")
            if tuple(layer.shape) != page:
                bad(f"layer {layer.index}: page shape {tuple(layer.shape)}, expected {page}")
        else:
            if layer.kind != "gdn":
                bad(f"layer {layer.index}: node has GDN, sender says {layer.kind}")
            if (layer.conv_dim, layer.conv_width) != (cfg.conv_dim, cfg.conv_kernel - 1):
                bad(f"layer {layer.index}: conv (dim, width) {(layer.conv_dim, layer.conv_width)}, "
                    f"expected {(cfg.conv_dim, cfg.conv_kernel - 1)}")
            want = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            if layer.rec_dims != want:
                bad(f"layer {layer.index}: recurrent (heads, dk, dv) {layer.rec_dims}, expected {want}")


def drafter_layers(layout: Layout, num_layers: int) -> list[LayerLayout]:
    """The layers past the target's `num_layers`: the MTP drafter's (layout version 4)."""
    return [layer for layer in layout.layers if layer.index >= num_layers]


def _layer_to_wire(layer: LayerLayout) -> dict:
    d = asdict(layer)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _ints(x, n: int, what: str) -> tuple[int, ...]:
    t = tuple(int(v) for v in x)
    if len(t) != n or any(v < 0 for v in t):
        raise ProtocolError(Reason.BAD_MESSAGE, f"{what} must be {n} non-negative ints, got {x!r}")
    return t


def _dtype(x: Any, what: str) -> str:
    if x not in DTYPE_SIZES:
        raise ProtocolError(Reason.BAD_MESSAGE, f"{what} {x!r} not one of {sorted(DTYPE_SIZES)}")
    return x


def _layer_from_wire(d: dict) -> LayerLayout:
    kind = d.get("kind")
    if kind == "attention":
        kv_format = d.get("kv_format", "packed")
        if kv_format not in KV_FORMATS:
            raise ProtocolError(Reason.BAD_MESSAGE, f"layer {d.get('index')}: kv_format {kv_format!r} not in {KV_FORMATS}")
        layer = AttentionLayout(index=int(d["index"]), dtype=_dtype(d["dtype"], "dtype"),
                                shape=_ints(d["shape"], 3, "shape"), strides=_ints(d["strides"], 3, "strides"),
                                kv_format=kv_format)
        if layer.shape[2] % 2:
            raise ProtocolError(Reason.BAD_MESSAGE, f"layer {layer.index}: last dim must be 2*head_dim")
        return layer
    if kind == "gdn":
        if d.get("conv_layout") not in CONV_LAYOUTS or d.get("rec_layout") not in REC_LAYOUTS:
            raise ProtocolError(Reason.BAD_MESSAGE,
                                f"gdn layer {d.get('index')}: conv_layout in {CONV_LAYOUTS}, rec_layout in {REC_LAYOUTS}")
        layer = GDNLayout(index=int(d["index"]), conv_layout=d["conv_layout"],
                         conv_dtype=_dtype(d["conv_dtype"], "conv_dtype"),
                         conv_shape=_ints(d["conv_shape"], 2, "conv_shape"),
                         conv_strides=_ints(d["conv_strides"], 2, "conv_strides"),
                         rec_layout=d["rec_layout"], rec_dtype=_dtype(d["rec_dtype"], "rec_dtype"),
                         rec_shape=_ints(d["rec_shape"], 3, "rec_shape"),
                         rec_strides=_ints(d["rec_strides"], 3, "rec_strides"),
                         rec_offset=_ints([d.get("rec_offset", 0)], 1, "rec_offset")[0])
        if layer.rec_offset and layer.rec_offset < layer.conv_bytes:
            raise ProtocolError(Reason.BAD_MESSAGE, f"gdn layer {layer.index}: rec_offset {layer.rec_offset} inside "
                                f"the conv state ({layer.conv_bytes} B)")
        return layer
    raise ProtocolError(Reason.BAD_MESSAGE, f"unknown layer kind {kind!r}")


__all__ = ["LAYOUT_VERSION", "LAYOUT_VERSIONS", "DTYPE_SIZES", "drafter_layers", "STATE_PAGE_DTYPES", "check_dtypes", "CONV_LAYOUTS", "KV_FORMATS", "REC_LAYOUTS", "AttentionLayout",
           "GDNLayout", "LayerLayout", "Layout", "span_elems", "contiguous_strides", "model_identity", "check_layout"]
