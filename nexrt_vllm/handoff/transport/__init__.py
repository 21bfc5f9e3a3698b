"""Transfer engines behind one interface (``base``), chosen by name from a registry.

Backends import the interface, never the reverse; a backend module (and its engine's native
library) is imported only when a transport of that name is made.
"""
from __future__ import annotations

import importlib

from nexrt_vllm.handoff.transport.base import (ReceiverTransport, SenderTransport, TransferError, TransferInFlight,
                                               Write, coalesce)

# name -> (module, receiver class, sender class)
_BACKENDS = {
    "mooncake": ("nexrt_vllm.handoff.transport.mooncake", "MooncakeReceiver", "MooncakeSender"),
    "nixl": ("nexrt_vllm.handoff.transport.nixl", "NixlReceiver", "NixlSender"),
}
TRANSPORTS = tuple(_BACKENDS)


def _backend(name: str, role: int):
    if name not in _BACKENDS:
        raise ValueError(f"unknown transport {name!r} ({' | '.join(TRANSPORTS)})")
    mod, *classes = _BACKENDS[name]
    return getattr(importlib.import_module(mod), classes[role])


def make_receiver(name: str, host: str = "127.0.0.1") -> ReceiverTransport:
    cls = _backend(name, 0)
    return cls(host) if name == "mooncake" else cls()


def make_sender(name: str, host: str = "127.0.0.1") -> SenderTransport:
    cls = _backend(name, 1)
    return cls(host) if name == "mooncake" else cls()


__all__ = ["TRANSPORTS", "ReceiverTransport", "SenderTransport", "TransferError", "TransferInFlight", "Write",
           "coalesce", "make_receiver", "make_sender"]
