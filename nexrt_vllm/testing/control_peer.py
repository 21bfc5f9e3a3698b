"""A scripted double of a decode node's control endpoint: the ROUTER socket that the sender's REQ
socket talks to (nexrt_vllm.handoff.protocol), answering from a table of replies."""
from __future__ import annotations

import threading
from typing import Callable

import zmq

from nexrt_vllm.handoff import protocol as P


class ControlPeer:
    """ROUTER socket on a free local port answering each message type with ``replies[type](msg)``
    (no entry, or None: no answer), in the protocol version it was spoken to; records every message
    it got in ``got`` and its version in ``versions_seen``. ``versions``: the protocol versions it
    speaks (an older node: ``(1,)``; others are refused with ``version_mismatch``, as such a node does)."""

    def __init__(self, replies: dict[str, Callable | None], versions: tuple[int, ...] = P.PROTOCOL_VERSIONS):
        self.replies, self.got, self.versions, self.versions_seen = replies, [], versions, []
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._serve, daemon=True)
        self._t.start()

    def _serve(self):
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            *ident, data = self.sock.recv_multipart()
            msg, v = P.decode_versioned(data)
            if v not in self.versions:
                refuse = P.Refuse(P.Reason.VERSION_MISMATCH.value, f"protocol version {v} unsupported")
                self.sock.send_multipart([*ident, P.encode(refuse, self.versions[0])])
                continue
            self.got.append(msg)
            self.versions_seen.append(v)
            reply = self.replies.get(msg.type)
            if reply is not None:
                self.sock.send_multipart([*ident, P.encode(reply(msg), v)])

    def close(self):
        self._stop.set()
        self._t.join(5)
        self.sock.close(linger=0)
