"""Transfer-engine interface: a receiver (decode node) exposes registered buffers, a sender (the
connector inside vLLM) writes into them one-sidedly.

Both ends register their memory once at start. The receiver advertises ``peer_info()`` (a
msgpack-able dict sent in ``hello_ok``); the sender ``connect``s to it once and then issues
batched ``write``s of ``(local_addr, remote_addr, nbytes)`` triples. Bounds are checked twice:
by ``nexrt_vllm.handoff`` against the region the node assigned, and by the engines themselves
(Mooncake's server and NIXL's descriptor lookup reject writes outside registered memory).

Memory kinds: ``"host"`` (plain or pinned DRAM) is supported by every backend; ``"device"``
(GPU memory registered directly, needs the CUDA builds) only where ``memory_kinds`` says so;
``device`` is then the CUDA device index. The decode node picks the kind (``--recv-memory``); with
pinned host buffers it does one async host-to-device copy per request before conversion
(``nexrt_vllm.node.buffers``). The connector registers vLLM's KV cache as ``"device"`` on a GPU,
or stages pages through pinned host memory where the backend cannot read GPU memory
(``nexrt_vllm.connector.staging``).
"""
from __future__ import annotations

import abc
from typing import Sequence

Write = tuple[int, int, int]  # (local address, remote address, nbytes)


class TransferError(Exception):
    """A transfer failed or did not finish in time; the state on the receiver is not usable."""


class TransferInFlight(TransferError):
    """A write timed out and could not be aborted: bytes may still land. The sender must not tell
    the receiver it stopped writing (no ``abort``); the receiver's timeout quarantines the buffer."""


class _Transport(abc.ABC):
    """What both ends have: a backend name, the memory kinds it registers, register and close."""

    name: str
    memory_kinds: tuple[str, ...] = ("host",)

    @abc.abstractmethod
    def register(self, addr: int, size: int, kind: str = "host", device: int = 0) -> None:
        """Register memory once, at start: the receiver's receive buffer, or a sender's source
        region (e.g. vLLM's KV cache tensors)."""

    @abc.abstractmethod
    def close(self) -> None: ...


class ReceiverTransport(_Transport):
    @abc.abstractmethod
    def peer_info(self) -> dict:
        """What a sender needs to reach this receiver (goes into ``hello_ok.transport``)."""


class SenderTransport(_Transport):
    @abc.abstractmethod
    def unregister(self, addr: int) -> None:
        """Drop a region registered at ``addr`` (before its memory is freed)."""

    @abc.abstractmethod
    def connect(self, peer_info: dict) -> str:
        """Make the receiver known; returns a peer handle for ``write``. Idempotent per peer."""

    @abc.abstractmethod
    def write(self, peer: str, writes: Sequence[Write], timeout: float) -> None:
        """Write all ``writes`` (one batch); returns when they landed, raises TransferError."""


def _check_kind(t, kind: str) -> None:
    if kind not in t.memory_kinds:
        raise ValueError(f"{t.name} transport cannot register {kind!r} memory (supports {t.memory_kinds})")


def coalesce(writes: Sequence[Write]) -> list[Write]:
    """Merge writes that are contiguous on both ends (sorted by remote address)."""
    out: list[list[int]] = []
    for loc, rem, n in sorted(writes, key=lambda w: w[1]):
        if n <= 0:
            continue
        if out and out[-1][0] + out[-1][2] == loc and out[-1][1] + out[-1][2] == rem:
            out[-1][2] += n
        else:
            out.append([loc, rem, n])
    return [tuple(w) for w in out]
