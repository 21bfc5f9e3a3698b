"""Sender side of the hand-off, shared by the vLLM connector, the tests and the benchmark.

    sender = HandoffSender("mooncake")              # or "nixl", or a SenderTransport
    sender.register(cache_addr, cache_bytes)        # once: the memory pages are read from
    t = sender.begin(control_addr, layout, rid, generation, seq_len, prompt=ids)  # hello (cached) + begin
    t.write_pages({layer_index: [page_addr, ...]})  # or t.write([(local, remote_offset, n), ...])
    t.done()                                        # -> ack; or t.abort("why")

With the prompt's token ids (``prompt``, packed by ``nexrt_vllm.handoff.prefix.pack_ids``) a node that
holds the conversation's leading tokens says so in ``accept`` (``t.held_tokens``); ``write_pages``
then skips the pages it holds (``t.slot``). A node that speaks only protocol version 1 gets a
full hand-off.

``send(...)`` does all of it in one call. Every failure is a ``HandoffError`` whose ``reason`` is a
``protocol.Reason``: node refusals keep the node's reason, a dead/silent node is ``TIMEOUT``, a
failed write is ``TRANSFER_FAILED`` (after which an ``abort`` is sent best-effort, so the node
frees the slot at once instead of waiting for its transfer timeout).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import msgpack
import zmq

from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.transport import SenderTransport, TransferError, TransferInFlight, coalesce, make_sender


class HandoffError(Exception):
    def __init__(self, reason: P.Reason, message: str):
        super().__init__(f"{P.Reason(reason).value}: {message}")
        self.reason = P.Reason(reason)
        self.message = message


@dataclass
class _Peer:
    transport_peer: str
    node: dict
    layout_key: bytes
    version: int = P.PROTOCOL_VERSION  # the protocol version the node speaks


@dataclass
class Transfer:
    """One accepted hand-off; regions are where the node wants each layer's pages."""

    sender: "HandoffSender"
    control_addr: str
    peer: str
    rid: str
    generation: int
    seq_len: int
    base: int
    size: int
    regions: dict[int, P.Region]
    deadline_s: float
    nbytes: int = 0
    seconds: float = 0.0  # time spent in transport writes
    descriptors: int = 0  # transport descriptors issued, after coalescing
    finished: bool = field(default=False)
    part: int = 0  # this sender's part of a TP prefill (its layout's sharding.tp_rank)
    layout: L.Layout | None = None
    held_tokens: int = 0  # leading tokens the node holds (accept.held_tokens): their attention pages stay home
    version: int = P.PROTOCOL_VERSION

    def __post_init__(self):
        layers = self.layout.layers if self.layout is not None and self.held_tokens else ()
        self._skip = {layer.index: self.layout.first_page(layer, self.held_tokens) for layer in layers}

    def slot(self, layer: int, page: int) -> int | None:
        """The region slot of ``layer``'s page ``page`` (in sequence order), or None when the node
        holds that page already."""
        if layer not in self.regions:
            raise HandoffError(P.Reason.LAYOUT_MISMATCH, f"layer {layer} has no region on the node")
        skip = self._skip.get(layer, 0)
        return page - skip if page >= skip else None

    def write(self, writes: Sequence[tuple[int, int, int]]) -> None:
        """Write ``(local_addr, remote_offset, nbytes)`` triples (offsets relative to the buffer)."""
        for _, off, n in writes:
            if off < 0 or n < 0 or off + n > self.size:
                self.abort("write out of bounds")
                raise HandoffError(P.Reason.BAD_MESSAGE,
                                   f"write [{off}, {off + n}) outside the receive buffer [0, {self.size})")
        batch = coalesce([(loc, self.base + off, n) for loc, off, n in writes])
        t0 = time.perf_counter()
        try:
            self.sender.transport.write(self.peer, batch, timeout=self.sender.transfer_timeout)
        except TransferError as e:
            self.sender._peers.pop(self.control_addr, None)  # re-hello next time (the node may have restarted)
            if isinstance(e, TransferInFlight):
                self.finished = True  # no abort: the node must keep the buffer until its own timeout
            else:
                self.abort(f"transfer failed: {e}")
            raise HandoffError(P.Reason.TRANSFER_FAILED, str(e)) from None
        self.seconds += time.perf_counter() - t0
        self.nbytes += sum(w[2] for w in batch)
        self.descriptors += len(batch)

    def write_pages(self, pages: Mapping[int, Sequence[int]]) -> None:
        """``{layer index: [local page address, ...]}``: page i of a layer lands in its slot
        (``slot``: i, less the pages the node holds, which are not sent).

        Attention layers give ``ceil(seq_len/block_size)`` pages in sequence order, GDN layers one.
        """
        writes = []
        for layer, addrs in pages.items():
            reg = self.regions.get(layer)
            slots = [(self.slot(layer, i), a) for i, a in enumerate(addrs)]
            slots = [(i, a) for i, a in slots if i is not None]
            if len(slots) > reg.num_pages:
                raise HandoffError(P.Reason.TOO_LONG, f"layer {layer}: {len(slots)} pages for {reg.num_pages} slots")
            writes += [(a, reg.offset + i * reg.page_bytes, reg.page_bytes) for i, a in slots]
        self.write(writes)

    def done(self) -> P.Ack:
        reply = self.sender._request(self.control_addr, P.Done(self.rid, self.generation, self.seq_len, self.nbytes,
                                                                part=self.part), self.version)
        self.finished = True
        if isinstance(reply, P.Error):
            raise HandoffError(reply.reason, reply.message)
        return _expect(reply, P.Ack)

    def abort(self, reason: str) -> None:
        """Tell the node to drop this admission; best effort (the node also times out)."""
        if self.finished:
            return
        self.finished = True
        try:
            self.sender._request(self.control_addr, P.Abort(self.rid, self.generation, reason, part=self.part),
                                 self.version)
        except HandoffError:
            pass


class HandoffSender:
    def __init__(self, transport: str | SenderTransport, *, host: str = "127.0.0.1", control_timeout: float = 5.0,
                 transfer_timeout: float = 30.0):
        self.transport = make_sender(transport, host) if isinstance(transport, str) else transport
        self.control_timeout = control_timeout
        self.transfer_timeout = transfer_timeout
        self._ctx = zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()  # guards the dicts; one lock per node serialises its REQ socket
        self._node_locks: dict[str, threading.Lock] = {}

    def register(self, addr: int, size: int, kind: str = "host", device: int = 0) -> None:
        self.transport.register(addr, size, kind, device)

    def unregister(self, addr: int) -> None:
        self.transport.unregister(addr)

    def hello(self, control_addr: str, layout: L.Layout) -> _Peer:
        """Version/layout check with the node; cached per (node, layout). A node that refuses this
        protocol version is asked again in version 1 (it then gets full hand-offs)."""
        wire = layout.to_wire()
        key = msgpack.packb(wire)
        peer = self._peers.get(control_addr)
        if peer is not None and peer.layout_key == key:
            return peer
        version = P.PROTOCOL_VERSION
        reply = self._request(control_addr, P.Hello(wire), version)
        if isinstance(reply, P.Refuse) and reply.reason is P.Reason.VERSION_MISMATCH:
            version = P.PROTOCOL_VERSIONS[0]
            reply = self._request(control_addr, P.Hello(wire), version)
        if isinstance(reply, P.Refuse):
            raise HandoffError(reply.reason, reply.message)
        reply = _expect(reply, P.HelloOk)
        try:
            tpeer = self.transport.connect(reply.transport)
        except TransferError as e:
            raise HandoffError(P.Reason.TRANSFER_FAILED, str(e)) from None
        peer = self._peers[control_addr] = _Peer(tpeer, reply.node, key, version)
        return peer

    def begin(self, control_addr: str, layout: L.Layout, rid: str, generation: int, seq_len: int,
              prompt: bytes | None = None) -> Transfer:
        """hello (cached) + begin. ``prompt``: the prompt's ``seq_len`` token ids (``prefix.pack_ids``),
        so that a node holding their leading tokens says so (``Transfer.held_tokens``)."""
        try:
            peer = self.hello(control_addr, layout)
        except HandoffError as e:
            if e.reason is not P.Reason.TIMEOUT:
                # The node answers but this sender cannot serve it (refused layout, foreign
                # transport): say so, so that the admission ends now, not at its begin deadline.
                try:
                    self._request(control_addr, P.Abort(rid, generation, f"{e.reason.value}: {e.message}"))
                except HandoffError:
                    pass
            raise
        if peer.version < 2:
            prompt = None
        reply = self._request(control_addr, P.Begin(rid, generation, seq_len, layout.to_wire(), prompt=prompt),
                              peer.version)
        if isinstance(reply, P.Reject):
            raise HandoffError(reply.reason, reply.message)
        acc = _expect(reply, P.Accept)
        t = Transfer(self, control_addr, peer.transport_peer, rid, acc.generation, seq_len,
                     int(acc.buffer["base"]), int(acc.buffer["size"]),
                     {r.layer: r for r in acc.region_list()}, float(acc.deadline_s),
                     part=layout.sharding.tp_rank if layout.sharding is not None else 0, layout=layout,
                     held_tokens=acc.held_tokens, version=peer.version)
        if acc.held_tokens and (prompt is None or layout.sharding is not None):
            t.abort("held_tokens without a prompt")
            raise HandoffError(P.Reason.BAD_MESSAGE,
                               f"node holds {acc.held_tokens} tokens of a prompt it was not given")
        try:
            layout.check_held(acc.held_tokens, seq_len)
        except P.ProtocolError as e:
            t.abort(e.message)
            raise HandoffError(e.reason, e.message) from None
        return t

    def send(self, control_addr: str, layout: L.Layout, rid: str, generation: int, seq_len: int,
             pages: Mapping[int, Sequence[int]], prompt: bytes | None = None) -> Transfer:
        t = self.begin(control_addr, layout, rid, generation, seq_len, prompt)
        try:
            t.write_pages(pages)
        except HandoffError:
            t.abort("sender error")
            raise
        t.done()
        return t

    def close(self) -> None:
        with self._lock:
            for s in self._sockets.values():
                s.close(linger=0)
            self._sockets.clear()
            self._peers.clear()
        self.transport.close()

    def _request(self, control_addr: str, msg, version: int = P.PROTOCOL_VERSION):
        """One REQ/REP round trip with a deadline; a timed-out socket is discarded (REQ state)."""
        with self._lock:
            node_lock = self._node_locks.setdefault(control_addr, threading.Lock())
        with node_lock:
            with self._lock:
                sock = self._sockets.get(control_addr)
                if sock is None:
                    sock = self._sockets[control_addr] = self._ctx.socket(zmq.REQ)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(control_addr)
            sock.send(P.encode(msg, version))
            if not sock.poll(int(self.control_timeout * 1000)):
                with self._lock:
                    sock.close(linger=0)
                    self._sockets.pop(control_addr, None)
                    self._peers.pop(control_addr, None)
                raise HandoffError(P.Reason.TIMEOUT,
                                   f"no reply from {control_addr} to {msg.type} in {self.control_timeout}s")
            data = sock.recv()
        try:
            return P.decode(data)
        except P.ProtocolError as e:
            raise HandoffError(e.reason, f"bad reply from node: {e.message}") from None


def _expect(reply, cls):
    if isinstance(reply, (P.Refuse, P.Reject, P.Error)):
        raise HandoffError(reply.reason, reply.message)
    if not isinstance(reply, cls):
        raise HandoffError(P.Reason.BAD_MESSAGE, f"expected {cls.type}, got {reply.type}")
    return reply
