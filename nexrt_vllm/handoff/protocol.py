"""Wire protocol between the prefill side (NexRT connector inside vLLM) and a NexRT decode node.

Control messages travel over ZMQ (sender REQ -> node ROUTER) as msgpack maps. Every message has
``"type"`` and ``"v"`` (its protocol version: ``PROTOCOL_VERSION`` unless the peer speaks an older
one). The exchange for one request (docs/ARCHITECTURE.md §2):

=========  =================================================  ==========================================
sender     fields                                             node answers
=========  =================================================  ==========================================
hello      layout                                             hello_ok{transport, node} | refuse{reason}
begin      rid, generation, seq_len, layout, prompt?          accept{rid, generation, buffer, regions,
                                                              held_tokens} | reject{reason}
(writes)   the sender writes pages with the transport into ``buffer`` at the region offsets
done       rid, generation, seq_len, nbytes, part?            ack{rid, generation} | error{reason}
abort      rid, generation, reason, part?                     ack{rid, generation} | error{reason}
=========  =================================================  ==========================================

Refusals carry a machine-readable ``reason`` (one of ``Reason``) and a human ``message``.

A prefill pool at TP = N ships one request as N parts: every part sends its own ``begin`` (its
layout's ``sharding`` names the part, ``nexrt_vllm.handoff.sharding``), writes its pages and sends
``done``/``abort`` with ``part`` = its ``tp_rank`` (0 when absent: an unsharded hand-off). The
node's admission is complete when every part's ``done`` arrived.

Context cache (version 2): ``begin.prompt`` is the prompt's token ids (``nexrt_vllm.handoff.prefix``);
``accept.held_tokens`` says how many leading tokens of it the node already holds (0: none, the
full hand-off). The sender then skips the first ``held_tokens / block_size`` pages of every
attention layer of the model (``Layout.first_page``); the regions hold only the pages that travel.

Versions: a node takes every version of ``PROTOCOL_VERSIONS`` and answers in the version it was
spoken to (``decode_versioned`` / ``encode(msg, v)``); a sender whose ``hello`` a node refuses with
``version_mismatch`` says ``hello`` again in version 1 and keeps to it with that node.

The layout descriptor both hello and begin carry is ``nexrt_vllm.handoff.layout``.

This module imports neither torch nor numpy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import msgpack

from nexrt_vllm.handoff.wire import ContractError, WireBody, as_enum, check_type

# 1: the first version. ``part`` of done / abort (layout version 2, tensor-parallel senders) was
#    added as an optional field read as 0 when absent, so older senders still match.
# 2: the context cache: begin's optional ``prompt`` (the prompt's token ids) and accept's
#    ``held_tokens`` (leading tokens whose attention pages the sender skips). Encoded in version 1
#    a message leaves both out, so a version-1 peer reads what it always read (a full hand-off).
PROTOCOL_VERSION = 2
PROTOCOL_VERSIONS = (1, 2)
_SINCE_2 = {"begin": ("prompt",), "accept": ("held_tokens",)}  # fields version 1 does not carry
REGION_ALIGN = 256  # region offsets are aligned so page copies stay vectorisable on both ends


class Reason(str, Enum):
    """Why a message was refused. Values are the wire strings."""

    BAD_MESSAGE = "bad_message"  # undecodable, missing/ill-typed field, unknown type
    VERSION_MISMATCH = "version_mismatch"  # message "v" not in PROTOCOL_VERSIONS
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
# Control messages: wire bodies (``nexrt_vllm.handoff.wire``) whose wire map is their fields in
# declaration order, ``type`` included; ``encode`` adds ``"v"``.


@dataclass(frozen=True)
class Region(WireBody):
    """One layer's slice of the receive buffer: page i goes to ``offset + i*page_bytes``."""

    layer: int
    kind: str
    offset: int
    page_bytes: int
    num_pages: int

    BODY = "accept.regions"

    def __post_init__(self):
        for name in ("layer", "offset", "page_bytes", "num_pages"):
            check_type(self.BODY, name, getattr(self, name), int)
        check_type(self.BODY, "kind", self.kind, str)

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.num_pages


class _Message(WireBody):
    """A control message; ``BODY`` is its ``type``."""

    def _check(self, **kinds: type) -> None:
        for name, kind in kinds.items():
            check_type(self.BODY, name, getattr(self, name), kind)

    def _reason(self) -> None:
        self._set("reason", as_enum(self.BODY, "reason", self.reason, Reason,
                                    f"{self.reason!r} is not a protocol reason"))


@dataclass(frozen=True)
class Hello(_Message):
    BODY = "hello"
    layout: dict  # Layout.to_wire()
    type: str = field(default=BODY, init=False)

    def __post_init__(self):
        self._check(layout=dict)


@dataclass(frozen=True)
class HelloOk(_Message):
    BODY = "hello_ok"
    transport: dict  # backend peer info, see nexrt_vllm.handoff.transport.base.ReceiverTransport.peer_info
    node: dict  # {"model": ..., "max_seq_len": ...}
    type: str = field(default=BODY, init=False)

    def __post_init__(self):
        self._check(transport=dict, node=dict)


@dataclass(frozen=True)
class Refuse(_Message):
    BODY = "refuse"
    reason: Reason
    message: str
    type: str = field(default=BODY, init=False)

    def __post_init__(self):
        self._reason()
        self._check(message=str)


@dataclass(frozen=True)
class Begin(_Message):
    BODY = "begin"
    rid: str
    generation: int
    seq_len: int
    layout: dict
    type: str = field(default=BODY, init=False)
    prompt: bytes | None = None  # version 2: the prompt's seq_len token ids (prefix.pack_ids); None: not given

    def __post_init__(self):
        self._check(rid=str, generation=int, seq_len=int, layout=dict)
        if self.prompt is not None:
            self._check(prompt=bytes)

    def to_wire(self) -> dict:
        d = super().to_wire()
        if self.prompt is None:
            del d["prompt"]
        return d


@dataclass(frozen=True)
class Accept(_Message):
    BODY = "accept"
    rid: str
    generation: int
    buffer: dict  # {"base": remote address, "size": bytes} of the buffer assigned to this request
    regions: list  # [Region.to_wire()]; use .region_list()
    deadline_s: float  # done must arrive within this many seconds
    type: str = field(default=BODY, init=False)
    held_tokens: int = 0  # version 2: leading prompt tokens the node holds; their attention pages stay home

    def __post_init__(self):
        self._check(rid=str, generation=int, buffer=dict, regions=list, deadline_s=float, held_tokens=int)
        if self.held_tokens < 0:
            raise ContractError(self.BODY, "held_tokens", f"must be >= 0, got {self.held_tokens}")

    def region_list(self) -> list[Region]:
        return [Region.from_wire(r) for r in self.regions]


@dataclass(frozen=True)
class Reject(_Message):
    BODY = "reject"
    rid: str
    reason: Reason
    message: str
    type: str = field(default=BODY, init=False)

    def __post_init__(self):
        self._reason()
        self._check(rid=str, message=str)


@dataclass(frozen=True)
class Done(_Message):
    BODY = "done"
    rid: str
    generation: int
    seq_len: int
    nbytes: int
    type: str = field(default=BODY, init=False)
    part: int = 0  # tp_rank of the sender's part (layout sharding); layout version 2

    def __post_init__(self):
        self._check(rid=str, generation=int, seq_len=int, nbytes=int, part=int)


@dataclass(frozen=True)
class Abort(_Message):
    BODY = "abort"
    rid: str
    generation: int
    reason: str  # free text for the node's log, not a ``Reason``
    type: str = field(default=BODY, init=False)
    part: int = 0

    def __post_init__(self):
        self._check(rid=str, generation=int, reason=str, part=int)


@dataclass(frozen=True)
class Ack(_Message):
    BODY = "ack"
    rid: str
    generation: int
    type: str = field(default=BODY, init=False)

    def __post_init__(self):
        self._check(rid=str, generation=int)


@dataclass(frozen=True)
class Error(_Message):
    BODY = "error"
    rid: str
    reason: Reason
    message: str
    type: str = field(default=BODY, init=False)

    def __post_init__(self):
        self._reason()
        self._check(rid=str, message=str)


MESSAGES = {c.BODY: c for c in (Hello, HelloOk, Refuse, Begin, Accept, Reject, Done, Abort, Ack, Error)}


def encode(msg: _Message, version: int = PROTOCOL_VERSION) -> bytes:
    """The message in protocol ``version``; in version 1 without the fields version 2 added (a
    ValueError if one of them says something a version-1 peer would miss)."""
    if version not in PROTOCOL_VERSIONS:
        raise ValueError(f"protocol version {version!r} not one of {PROTOCOL_VERSIONS}")
    wire = msg.to_wire()
    if version < 2:
        for name in _SINCE_2.get(msg.BODY, ()):
            if wire.pop(name, None) not in (None, 0):
                raise ValueError(f"{msg.BODY}.{name} cannot be said in protocol version {version}")
    return msgpack.packb({**wire, "v": version}, use_bin_type=True)


def decode(data: bytes) -> _Message:
    """bytes -> message; raises ProtocolError(BAD_MESSAGE | VERSION_MISMATCH)."""
    return decode_versioned(data)[0]


def decode_versioned(data: bytes) -> tuple[_Message, int]:
    """bytes -> (message, the protocol version it was spoken in); ProtocolError as ``decode``."""
    try:
        d = msgpack.unpackb(data, raw=False)
    except Exception as e:  # noqa: BLE001 - any msgpack failure is a bad message
        raise ProtocolError(Reason.BAD_MESSAGE, f"undecodable message: {e!r}") from None
    if not isinstance(d, dict):
        raise ProtocolError(Reason.BAD_MESSAGE, "message must be a map")
    v = d.get("v")
    if v not in PROTOCOL_VERSIONS or isinstance(v, bool):
        raise ProtocolError(Reason.VERSION_MISMATCH,
                            f"protocol version {v!r} unsupported (node speaks {list(PROTOCOL_VERSIONS)})")
    cls = MESSAGES.get(d.get("type"))
    if cls is None:
        raise ProtocolError(Reason.BAD_MESSAGE, f"unknown message type {d.get('type')!r}")
    try:
        return cls.from_wire(d), v
    except ContractError as e:
        raise ProtocolError(Reason.BAD_MESSAGE, str(e)) from None


def reply_version(data: bytes) -> int:
    """The version to answer raw ``data`` in, even when it does not decode: its own when spoken here,
    else version 1 (every sender reads a version-1 refusal)."""
    try:
        v = msgpack.unpackb(data, raw=False).get("v")
    except Exception:  # noqa: BLE001 - undecodable: the oldest version
        return PROTOCOL_VERSIONS[0]
    return v if v in PROTOCOL_VERSIONS and not isinstance(v, bool) else PROTOCOL_VERSIONS[0]


def region_dicts(regions: list[Region]) -> list[dict]:
    return [r.to_wire() for r in regions]


__all__ = [
    "PROTOCOL_VERSION", "PROTOCOL_VERSIONS", "REGION_ALIGN", "Reason", "ProtocolError", "Region", "Hello", "HelloOk",
    "Refuse", "Begin", "Accept", "Reject", "Done", "Abort", "Ack", "Error", "encode", "decode", "decode_versioned",
    "reply_version", "region_dicts", "align_up",
]
