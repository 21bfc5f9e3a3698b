"""Mooncake Transfer Engine backend (P2P handshake, no metadata server).

Mooncake's TCP transport (used when no RDMA NIC exists) listens on **all interfaces**, whatever
host is passed to ``initialize``; ``host`` is only the address it advertises. Firewall the node
accordingly. Every Mooncake call returns 0 on success; anything else is an error.
"""
from __future__ import annotations

import time
from typing import Sequence

from nexrt_vllm.handoff.transport.base import ReceiverTransport, SenderTransport, TransferError, Write, _check_kind


def _engine(host: str):
    from mooncake.engine import TransferEngine

    eng = TransferEngine()
    rc = eng.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise TransferError(f"mooncake initialize({host!r}) returned {rc}")
    return eng


class _MooncakeBase:
    """What both ends share: one engine, registrations released on close."""

    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1"):
        self._host = host  # the address advertised to peers
        self._eng = _engine(host)
        self._regs: list[int] = []

    def register(self, addr: int, size: int, kind: str = "host") -> None:
        _check_kind(self, kind)
        rc = self._eng.register_memory(addr, size)
        if rc != 0:
            raise TransferError(f"mooncake register_memory({addr:#x}, {size}) returned {rc}")
        self._regs.append(addr)

    def close(self) -> None:
        for addr in self._regs:
            self._eng.unregister_memory(addr)
        self._regs.clear()


class MooncakeReceiver(_MooncakeBase, ReceiverTransport):
    def peer_info(self) -> dict:
        return {"backend": self.name, "target": f"{self._host}:{self._eng.get_rpc_port()}"}


class MooncakeSender(_MooncakeBase, SenderTransport):
    def unregister(self, addr: int) -> None:
        if addr in self._regs:
            self._regs.remove(addr)
            rc = self._eng.unregister_memory(addr)
            if rc != 0:
                raise TransferError(f"mooncake unregister_memory({addr:#x}) returned {rc}")

    def connect(self, peer_info: dict) -> str:
        if peer_info.get("backend") != self.name or not isinstance(peer_info.get("target"), str):
            raise TransferError(f"not a mooncake peer: {peer_info!r}")
        return peer_info["target"]  # the handshake happens lazily on the first write

    def write(self, peer: str, writes: Sequence[Write], timeout: float) -> None:
        if not writes:
            return
        t0 = time.monotonic()
        # Synchronous batch: Mooncake bounds it itself (a dead peer fails in milliseconds); the
        # deadline is still checked so a slow link is reported as a failure, not as success.
        rc = self._eng.batch_transfer_sync_write(peer, [w[0] for w in writes], [w[1] for w in writes],
                                                 [w[2] for w in writes])
        if rc != 0:
            raise TransferError(f"mooncake write to {peer} failed (rc={rc})")
        if time.monotonic() - t0 > timeout:
            raise TransferError(f"mooncake write to {peer} took longer than {timeout}s")
