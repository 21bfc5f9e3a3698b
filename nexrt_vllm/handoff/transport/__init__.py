"""Transfer engines behind one interface (``base``), chosen by name from a registry.

Backends import the interface, never the reverse; a backend module (and its engine's native
library) is imported only when a transport of that name is made.
"""
from __future__ import annotations

import importlib

from nexrt_vllm.handoff.transport.base import (ReceiverTransport, SenderTransport, TransferError, TransferInFlight,
                                               Write, coalesce)

# name -> (module, receiver class, sender class, whether they take the address to advertise)
_BACKENDS = {
    "mooncake": ("nexrt_vllm.handoff.transport.mooncake", "MooncakeReceiver", "MooncakeSender", True),
    "nixl": ("nexrt_vllm.handoff.transport.nixl", "NixlReceiver", "NixlSender", False),
}
TRANSPORTS = tuple(_BACKENDS)


def _make(name: str, role: int, host: str):
    if name not in _BACKENDS:
        raise ValueError(f"unknown transport {name!r} ({' | '.join(TRANSPORTS)})")
    mod, receiver, sender, takes_host = _BACKENDS[name]
    cls = getattr(importlib.import_module(mod), (receiver, sender)[role])
    return cls(host) if takes_host else cls()


def make_receiver(name: str, host: str = "127.0.0.1") -> ReceiverTransport:
    return _make(name, 0, host)


def make_sender(name: str, host: str = "127.0.0.1") -> SenderTransport:
    return _make(name, 1, host)


__all__ = ["TRANSPORTS", "ReceiverTransport", "SenderTransport", "TransferError", "TransferInFlight", "Write",
           "coalesce", "make_receiver", "make_sender"]
