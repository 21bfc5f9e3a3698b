"""Wire protocol between the prefill side (NexRT connector inside vLLM) and a NexRT decode node.

Control messages travel over ZMQ (sender REQ -> node ROUTER) as msgpack maps. Every message has
``"type"`` and ``"v"`` (= ``PROTOCOL_VERSION``). The exchange for one request (docs/ARCHITECTURE.md §2):

=========  =================================================  ==========================================
sender     fields                                             node answers
=========  =================================================  ==========================================
hello      layout                                             hello_ok{transport, node} | refuse{reason}
begin      rid, generation, seq_len, layout                   accept{rid, generation, buffer, regions}
                                                              | reject{reason}
(writes)   the sender writes pages with the transport into ``buffer`` at the region offsets
done       rid, generation, seq_len, nbytes                   ack{rid, generation} | error{reason}
abort      rid, generation, reason                            ack{rid, generation} | error{reason}
=========  =================================================  ==========================================

Refusals carry a machine-readable ``reason`` (one of ``Reason``) and a human ``message``.

The layout descriptor (``Layout``) describes the sender's pages so the node can validate and
convert them (``nexrt_vllm.node.convert``):

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

This module imports neither torch nor numpy.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
LAYOUT_VERSION = 1

# Bytes per element of every dtype a layout may name.
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1, "uint8": 1}
CONV_LAYOUTS = ("SD", "DS")
KV_FORMATS = ("packed", "cpu_vec", "cpu_amx")
REC_LAYOUTS = ("HVK", "HKV")
REGION_ALIGN = 256  # region offsets are aligned so page copies stay vectorisable on both ends


class Reason(str, Enum):
    """Why a message was refused. Values are the wire strings."""

    BAD_MESSAGE = "bad_message"  # undecodable, missing/ill-typed field, unknown type
    VERSION_MISMATCH = "version_mismatch"  # message "v" != PROTOCOL_VERSION
    LAYOUT_VERSION = "layout_version"  # layout["version"] != LAYOUT_VERSION
    LAYOUT_MISMATCH = "layout_mismatch"  # layout does not describe the node's model
    TOO_LONG = "too_long"  # seq_len over max_seq_len or over the receive buffer
    UNKNOWN_RID = "unknown_rid"  # rid was never admitted (or already finished)
    STALE_GENERATION = "stale_generation"  # generation of an earlier admission of this slot
    DUPLICATE = "duplicate"  # rid already admitted / begun
    DUPLICATE_DONE = "duplicate_done"  # second done for one admission
    SIZE_MISMATCH = "size_mismatch"  # done.nbytes / seq_len disagree with begin
    BUSY = "busy"
    CANCELLING = "cancelling"  # the previous request is still stopping
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    TRANSFER_FAILED = "transfer_failed"
    UNSUPPORTED = "unsupported"  # a generate option the node cannot honour (e.g. a grammar xgrammar cannot enforce)


class ProtocolError(Exception):
    """A typed refusal: ``reason`` is a ``Reason``; ``str(err)`` is the human message."""

    def __init__(self, reason: Reason, message: str):
        super().__init__(message)
        self.reason = Reason(reason)
        self.message = message

    def __repr__(self) -> str:
        return f"ProtocolError({self.reason.value}: {self.message})"


# --------------------------------------------------------------------------------------------
# Layout descriptor


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

    @property
    def conv_bytes(self) -> int:
        return span_elems(self.conv_shape, self.conv_strides) * DTYPE_SIZES[self.conv_dtype]

    @property
    def rec_bytes(self) -> int:
        return span_elems(self.rec_shape, self.rec_strides) * DTYPE_SIZES[self.rec_dtype]

    @property
    def page_bytes(self) -> int:
        return self.conv_bytes + self.rec_bytes

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

    def to_wire(self) -> dict:
        return {"version": self.version, "model": dict(self.model), "block_size": self.block_size,
                "layers": [_layer_to_wire(layer) for layer in self.layers]}

    @classmethod
    def from_wire(cls, d: Any) -> "Layout":
        """Parse and structurally validate a wire layout; raises ProtocolError."""
        if not isinstance(d, dict):
            raise ProtocolError(Reason.BAD_MESSAGE, "layout must be a map")
        if d.get("version") != LAYOUT_VERSION:
            raise ProtocolError(Reason.LAYOUT_VERSION,
                                f"layout version {d.get('version')!r} unsupported (node speaks {LAYOUT_VERSION})")
        try:
            block_size = int(d["block_size"])
            model = dict(d["model"])
            layers = tuple(_layer_from_wire(x) for x in d["layers"])
        except ProtocolError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(Reason.BAD_MESSAGE, f"malformed layout: {e!r}") from None
        if block_size <= 0:
            raise ProtocolError(Reason.BAD_MESSAGE, "layout block_size must be positive")
        idx = [layer.index for layer in layers]
        if len(set(idx)) != len(idx):
            raise ProtocolError(Reason.BAD_MESSAGE, "layout names a layer twice")
        return cls(model=model, block_size=block_size, layers=layers)

    def regions(self, seq_len: int) -> list["Region"]:
        """Where each layer's pages go in the receive buffer for a ``seq_len``-token request."""
        out, off = [], 0
        pages = math.ceil(seq_len / self.block_size)
        for layer in self.layers:
            n = pages if layer.kind == "attention" else 1
            out.append(Region(layer=layer.index, kind=layer.kind, offset=off,
                              page_bytes=layer.page_bytes, num_pages=n))
            off = align_up(off + n * layer.page_bytes)
        return out


def span_elems(shape, strides) -> int:
    """Elements spanned by a strided tensor (max offset + 1); 0 for an empty one."""
    if any(s <= 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, strides))


def align_up(n: int) -> int:
    return -(-n // REGION_ALIGN) * REGION_ALIGN


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
        return GDNLayout(index=int(d["index"]), conv_layout=d["conv_layout"],
                         conv_dtype=_dtype(d["conv_dtype"], "conv_dtype"),
                         conv_shape=_ints(d["conv_shape"], 2, "conv_shape"),
                         conv_strides=_ints(d["conv_strides"], 2, "conv_strides"),
                         rec_layout=d["rec_layout"], rec_dtype=_dtype(d["rec_dtype"], "rec_dtype"),
                         rec_shape=_ints(d["rec_shape"], 3, "rec_shape"),
                         rec_strides=_ints(d["rec_strides"], 3, "rec_strides"))
    raise ProtocolError(Reason.BAD_MESSAGE, f"unknown layer kind {kind!r}")


# --------------------------------------------------------------------------------------------
# Control messages


@dataclass(frozen=True)
class Region:
    """One layer's slice of the receive buffer: page i goes to ``offset + i*page_bytes``."""

    layer: int
    kind: str
    offset: int
    page_bytes: int
    num_pages: int

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.num_pages


@dataclass(frozen=True)
class Hello:
    layout: dict  # Layout.to_wire()
    type: str = "hello"


@dataclass(frozen=True)
class HelloOk:
    transport: dict  # backend peer info, see nexrt_vllm.handoff.transport.base.ReceiverTransport.peer_info
    node: dict  # {"model": ..., "max_seq_len": ...}
    type: str = "hello_ok"


@dataclass(frozen=True)
class Refuse:
    reason: str
    message: str
    type: str = "refuse"


@dataclass(frozen=True)
class Begin:
    rid: str
    generation: int
    seq_len: int
    layout: dict
    type: str = "begin"


@dataclass(frozen=True)
class Accept:
    rid: str
    generation: int
    buffer: dict  # {"base": remote address, "size": bytes} of the buffer assigned to this request
    regions: list  # [Region as dict]; use .region_list()
    deadline_s: float  # done must arrive within this many seconds
    type: str = "accept"

    def region_list(self) -> list[Region]:
        return [Region(**r) for r in self.regions]


@dataclass(frozen=True)
class Reject:
    rid: str
    reason: str
    message: str
    type: str = "reject"


@dataclass(frozen=True)
class Done:
    rid: str
    generation: int
    seq_len: int
    nbytes: int
    type: str = "done"


@dataclass(frozen=True)
class Abort:
    rid: str
    generation: int
    reason: str
    type: str = "abort"


@dataclass(frozen=True)
class Ack:
    rid: str
    generation: int
    type: str = "ack"


@dataclass(frozen=True)
class Error:
    rid: str
    reason: str
    message: str
    type: str = "error"


MESSAGES = {c.type: c for c in (Hello, HelloOk, Refuse, Begin, Accept, Reject, Done, Abort, Ack, Error)}
_FIELD_TYPES = {"rid": str, "generation": int, "seq_len": int, "nbytes": int, "layout": dict, "reason": str,
                "message": str, "transport": dict, "node": dict, "buffer": dict, "regions": list,
                "deadline_s": (int, float)}


def encode(msg) -> bytes:
    d = {f.name: getattr(msg, f.name) for f in fields(msg)}
    d["v"] = PROTOCOL_VERSION
    return msgpack.packb(d, use_bin_type=True)


def decode(data: bytes):
    """bytes -> message dataclass; raises ProtocolError(BAD_MESSAGE | VERSION_MISMATCH)."""
    try:
        d = msgpack.unpackb(data, raw=False)
    except Exception as e:  # noqa: BLE001 - any msgpack failure is a bad message
        raise ProtocolError(Reason.BAD_MESSAGE, f"undecodable message: {e!r}") from None
    if not isinstance(d, dict):
        raise ProtocolError(Reason.BAD_MESSAGE, "message must be a map")
    if d.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(Reason.VERSION_MISMATCH,
                            f"protocol version {d.get('v')!r} unsupported (node speaks {PROTOCOL_VERSION})")
    cls = MESSAGES.get(d.get("type"))
    if cls is None:
        raise ProtocolError(Reason.BAD_MESSAGE, f"unknown message type {d.get('type')!r}")
    kw = {}
    for f in fields(cls):
        if f.name == "type":
            continue
        if f.name not in d:
            raise ProtocolError(Reason.BAD_MESSAGE, f"{cls.type}: missing field {f.name!r}")
        v = d[f.name]
        want = _FIELD_TYPES[f.name]
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ProtocolError(Reason.BAD_MESSAGE, f"{cls.type}: field {f.name!r} has type {type(v).__name__}")
        kw[f.name] = v
    return cls(**kw)


def region_dicts(regions: list[Region]) -> list[dict]:
    return [asdict(r) for r in regions]


__all__ = [
    "PROTOCOL_VERSION", "LAYOUT_VERSION", "DTYPE_SIZES", "Reason", "ProtocolError", "AttentionLayout", "GDNLayout",
    "Layout", "Region", "Hello", "HelloOk", "Refuse", "Begin", "Accept", "Reject", "Done", "Abort", "Ack", "Error",
    "encode", "decode", "region_dicts", "span_elems", "align_up",
]
