"""Receive buffers: allocated and registered with the transport once, at node start.

Memory kinds (``--recv-memory``):

* ``host``   plain host memory; the CPU engine converts straight out of it.
* ``pinned`` page-locked host memory for a GPU node: the sender writes into host RAM, then the node
  does one async host-to-device copy of the received bytes and converts on the GPU.
* ``device`` GPU memory registered with the transport directly (needs a backend whose
  ``memory_kinds`` include ``"device"``: NIXL with CUDA, Mooncake's CUDA build; the non-CUDA
  Mooncake wheel refuses it).

Each buffer serves one admission at a time. A buffer whose writer may still be live (the transfer
timed out or was cancelled before ``done``/``abort``) is quarantined: it is not handed out again
until that writer's late ``done``/``abort`` arrives or the grace period passes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from nexrt_vllm.handoff.transport.base import ReceiverTransport

MEMORY_KINDS = ("host", "pinned", "device")


@dataclass
class RecvBuffer:
    index: int
    tensor: torch.Tensor  # 1-D uint8
    kind: str
    owner: int | None = None  # generation currently allowed to write
    quarantine_gen: int | None = None  # generation whose writer may still be live
    quarantine_until: float = 0.0
    quarantine_parts: set = field(default_factory=set)  # its parts that may still write (TP prefill)

    @property
    def addr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def size(self) -> int:
        return self.tensor.numel()

    def available(self, now: float) -> bool:
        if self.owner is not None:
            return False
        if self.quarantine_gen is not None and now >= self.quarantine_until:
            self.quarantine_gen = None
        return self.quarantine_gen is None

    def release(self, writer_live: bool, grace_s: float, parts=()) -> None:
        """``parts``: the live writers' part indices (none given: part 0, an unsharded hand-off)."""
        if writer_live:
            self.quarantine_gen, self.quarantine_until = self.owner, time.monotonic() + grace_s
            self.quarantine_parts = set(parts) or {0}
        self.owner = None

    def writer_finished(self, generation: int, part: int = 0) -> None:
        """A late done/abort from a quarantined writer: once every live part has sent one, the
        buffer is safe to reuse."""
        if self.quarantine_gen == generation:
            self.quarantine_parts.discard(part)
            if not self.quarantine_parts:
                self.quarantine_gen = None


def allocate(transport: ReceiverTransport, count: int, size: int, memory: str, device: str) -> list[RecvBuffer]:
    if memory not in MEMORY_KINDS:
        raise ValueError(f"recv memory {memory!r} not one of {MEMORY_KINDS}")
    if memory != "host" and not device.startswith("cuda"):
        raise ValueError(f"--recv-memory {memory} needs --device cuda")
    out = []
    for i in range(count):
        if memory == "device":
            t = torch.empty(size, dtype=torch.uint8, device=device)
        else:
            t = torch.empty(size, dtype=torch.uint8, pin_memory=(memory == "pinned"))
        transport.register(t.data_ptr(), size, "device" if memory == "device" else "host", t.device.index or 0)
        out.append(RecvBuffer(i, t, memory))
    return out


def stage(buf: RecvBuffer, nbytes: int, device: str) -> torch.Tensor:
    """The received bytes on the compute device: a view on host/device buffers, one async H2D copy
    for pinned ones (ordered before the conversion kernels on the same stream)."""
    view = buf.tensor[:nbytes]
    if buf.kind == "pinned":
        return view.to(device, non_blocking=True)
    return view
