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
done       rid, generation, seq_len, nbytes, part?            ack{rid, generation} | error{reason}
abort      rid, generation, reason, part?                     ack{rid, generation} | error{reason}
=========  =================================================  ==========================================

Refusals carry a machine-readable ``reason`` (one of ``Reason``) and a human ``message``.

A prefill pool at TP = N ships one request as N parts: every part sends its own ``begin`` (its
layout's ``sharding`` names the part, ``nexrt_vllm.handoff.sharding``), writes its pages and sends
``done``/``abort`` with ``part`` = its ``tp_rank`` (0 when absent: an unsharded hand-off). The
node's admission is complete when every part's ``done`` arrived.

The layout descriptor both hello and begin carry is ``nexrt_vllm.handoff.layout``.

This module imports neither torch nor numpy.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from enum import Enum

import msgpack

PROTOCOL_VERSION = 1
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


def align_up(n: int) -> int:
    return -(-n // REGION_ALIGN) * REGION_ALIGN


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
    part: int = 0  # tp_rank of the sender's part (layout sharding); layout version 2


@dataclass(frozen=True)
class Abort:
    rid: str
    generation: int
    reason: str
    type: str = "abort"
    part: int = 0


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
                "deadline_s": (int, float), "part": int}


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
        if f.name not in d and f.default is not MISSING:
            continue  # optional field: the dataclass default
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
    "PROTOCOL_VERSION", "REGION_ALIGN", "Reason", "ProtocolError", "Region", "Hello", "HelloOk", "Refuse", "Begin",
    "Accept", "Reject", "Done", "Abort", "Ack", "Error", "encode", "decode", "region_dicts", "align_up",
]
