"""Mooncake Transfer Engine backend (P2P handshake, no metadata server).

Mooncake's TCP transport (used when no RDMA NIC exists) listens on **all interfaces**, whatever
host is passed to ``initialize``; ``host`` is only the address it advertises. Firewall the node
accordingly. Every Mooncake call returns 0 on success; anything else is an error.

GPU memory: a CUDA build of the wheel (``mooncake.engine.SUPPORT_CUDA``, e.g.
``mooncake-transfer-engine-cuda13``) registers device memory. Its ``tcp`` protocol then copies
each 64 KiB chunk through a host bounce buffer (correct, slow); ``nvlink_intra`` (same host; the
receiver's buffers must be device memory, shared by CUDA IPC) copies GPU to GPU. The protocol is
``NEXRT_MOONCAKE_PROTOCOL`` (default ``tcp``) on both ends; a sender refuses a node whose protocol
differs.
"""
from __future__ import annotations

import os
import time
from typing import Sequence

from nexrt_vllm.handoff.transport.base import ReceiverTransport, SenderTransport, TransferError, Write, _check_kind

PROTOCOLS = ("tcp", "nvlink_intra")


def _protocol() -> str:
    proto = os.environ.get("NEXRT_MOONCAKE_PROTOCOL", "tcp")
    if proto not in PROTOCOLS:
        raise TransferError(f"NEXRT_MOONCAKE_PROTOCOL={proto!r} not one of {PROTOCOLS}")
    return proto


def _engine(host: str, protocol: str):
    from mooncake.engine import TransferEngine

    eng = TransferEngine()
    rc = eng.initialize(host, "P2PHANDSHAKE", protocol, "")
    if rc != 0:
        raise TransferError(f"mooncake initialize({host!r}, protocol {protocol!r}) returned {rc}")
    return eng


class _MooncakeBase:
    """What both ends share: one engine, registrations released on close."""

    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1"):
        from mooncake import engine

        self._host = host  # the address advertised to peers
        self.protocol = _protocol()
        if self.protocol != "tcp" and not getattr(engine, "SUPPORT_CUDA", False):
            raise TransferError(f"mooncake protocol {self.protocol!r} needs the CUDA build of the wheel")
        self._eng = _engine(host, self.protocol)
        self.memory_kinds = ("host", "device") if getattr(engine, "SUPPORT_CUDA", False) else ("host",)
        self._regs: list[int] = []

    def register(self, addr: int, size: int, kind: str = "host", device: int = 0) -> None:
        _check_kind(self, kind)
        # the location names the memory's device (NIC affinity for RDMA; nvlink_intra needs device memory)
        rc = self._eng.register_memory(addr, size, f"cuda:{device}" if kind == "device" else "*")
        if rc != 0:
            raise TransferError(f"mooncake register_memory({addr:#x}, {size}) returned {rc}")
        self._regs.append(addr)

    def close(self) -> None:
        for addr in self._regs:
            self._eng.unregister_memory(addr)
        self._regs.clear()


class MooncakeReceiver(_MooncakeBase, ReceiverTransport):
    def peer_info(self) -> dict:
        return {"backend": self.name, "target": f"{self._host}:{self._eng.get_rpc_port()}",
                "protocol": self.protocol}


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
        proto = peer_info.get("protocol", "tcp")
        if proto != self.protocol:
            raise TransferError(f"the node's mooncake protocol is {proto!r}, this sender's {self.protocol!r} "
                                "(set NEXRT_MOONCAKE_PROTOCOL alike on both ends)")
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
