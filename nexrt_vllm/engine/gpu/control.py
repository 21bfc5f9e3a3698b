"""The memory the host and the captured step share: the control ring and its neighbours.

The step's last kernel writes (step << 32 | token) into a ring of host-mapped pinned memory (one
8-byte store, so the host never sees a torn pair; if mapping is unavailable, a device ring plus a
copy node into pinned memory). The ring (not a single slot) means replay k+1 can land before the
host has read k. Beside it: the logprob ring, the grammar flag and mask slots, the speculative
round records, the batch step's ring (a column per request slot).
"""
from __future__ import annotations

import math
import time

import torch

from nexrt_vllm.engine.errors import EngineError

RING = 64  # control slots; must exceed the replays in flight (2)


def wait_record(ring: torch.Tensor, seq: int, timeout_s: float, what: str) -> int:
    """The value of record `seq` (seq << 32 | value, in slot (seq - 1) % RING of a host ring) once the
    captured work has published it; EngineError naming `what` after `timeout_s`."""
    slot = (seq - 1) % RING
    deadline = time.monotonic() + timeout_s
    while (v := int(ring[slot])) >> 32 != seq:
        if time.monotonic() > deadline:
            raise EngineError(f"{what} {seq} did not publish within {timeout_s}s")
    return v & 0xFFFFFFFF

_PAGE = 4096
_ALIGN = 128


def _control_specs(vocab_size: int, slots: int = 0) -> dict:
    """What the host and the step share, name -> (shape, dtype, initial value): the control ring; the
    logprob ring parallel to it (slot s: the chosen token's logprob then the top KMAX, and their
    ids); the grammar flag (masks of every step <= flag are written) and two mask slots (step % 2);
    the speculative round records (round << 32 | tokens emitted, engine/gpu/spec_round.py); with
    `slots`, the batch step's ring and the batched round's records (one column per request slot,
    engine/gpu/batch_runner.py, batch_round.py)."""
    from nexrt_vllm.engine.kernels.sampling import KMAX
    specs = {"ring": ((RING,), torch.int64, -1), "rounds": ((RING,), torch.int64, -1),
             "lpv": ((RING, KMAX + 1), torch.float32, 0),
             "lpi": ((RING, KMAX), torch.int32, 0), "flag": ((1,), torch.int64, 0),
             "masks": ((2, (vocab_size + 31) // 32), torch.int32, -1)}
    if slots:
        specs["slot_ring"] = ((RING, slots), torch.int64, -1)
        specs["slot_rounds"] = ((RING, slots), torch.int64, -1)
    return specs


class _Mapped:
    """Page-locked, device-mapped host memory holding the tensors of `specs`, unregistered when dropped.

    The tensors sit alone on whole pages of an over-allocated buffer (registration is per page, so no
    other allocation may share them). UVA: the mapped device address equals the host address."""

    def __init__(self, dev: torch.device, specs: dict):
        offs, n = {}, 0
        for name, (shape, dtype, _) in specs.items():
            offs[name] = n
            n += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        size = -(-n // _PAGE) * _PAGE
        self._backing = torch.zeros(size + _PAGE, dtype=torch.uint8)
        base = -self._backing.data_ptr() % _PAGE
        self._ptr = self._backing.data_ptr() + base
        rc = torch.cuda.cudart().cudaHostRegister(self._ptr, size, 2)  # cudaHostRegisterMapped
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister failed ({rc})")
        self.host, self.device = {}, {}
        for name, (shape, dtype, fill) in specs.items():
            nbytes = math.prod(shape) * dtype.itemsize
            h = self._backing[base + offs[name]:base + offs[name] + nbytes].view(dtype).view(shape)
            h.fill_(fill)
            self.host[name] = h

            class _Iface:
                __cuda_array_interface__ = {"shape": tuple(shape), "typestr": _TYPESTR[dtype],
                                            "data": (h.data_ptr(), False), "version": 3, "strides": None}
            self.device[name] = torch.as_tensor(_Iface(), device=dev)

    def __del__(self):
        torch.cuda.synchronize()  # no replay may still write the pages
        torch.cuda.cudart().cudaHostUnregister(self._ptr)


_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4", torch.float32: "<f4"}


class ControlMemory:
    """The host <-> step tensors (`_control_specs`), as host views and the device views kernels use.

    mode "host-mapped" (preferred): kernels write the rings over PCIe and read the grammar masks
    from host memory, so no copy node and no sync. "pinned-copy" (mapping failed): device rings
    copied into pinned memory by the graph's last nodes; grammar masks are then not available to
    the graph (`masks` False). "cpu": one set of tensors (the interpreter tests)."""

    def __init__(self, dev: torch.device, vocab_size: int, slots: int = 0):
        specs = _control_specs(vocab_size, slots)
        self._owner = None
        if dev.type != "cuda":
            self.mode, self.host = "cpu", {k: torch.full(sh, f, dtype=dt) for k, (sh, dt, f) in specs.items()}
            self.device = self.host
            return
        from nexrt_vllm.engine.kernels import sampling
        try:
            mem = _Mapped(dev, specs)
            # Round trip through the very kernel that publishes tokens: it writes, the host must see it.
            pm = torch.full((1,), 1.0, device=dev)
            pi = torch.full((1,), 9, dtype=torch.int32, device=dev)
            z = torch.zeros(1, dtype=torch.int64, device=dev)
            sampling.finish(pm, pi, 1, z.clone(), z.clone(), z.clone(), mem.device["ring"], RING)
            torch.cuda.synchronize()
            if int(mem.host["ring"][0]) == (1 << 32) | 9:
                mem.host["ring"].fill_(-1)
                self.mode, self.host, self.device, self._owner = "host-mapped", mem.host, mem.device, mem
                return
        except Exception:  # noqa: BLE001 - any failure means: use the copy path
            pass
        self.mode = "pinned-copy"
        self.host = {k: torch.full(sh, f, dtype=dt).pin_memory() for k, (sh, dt, f) in specs.items()}
        self.device = {k: torch.full(sh, f, dtype=dt, device=dev) for k, (sh, dt, f) in specs.items()}

    @property
    def masks(self) -> bool:
        """Whether the step can wait for and read host-written grammar masks."""
        return self.mode in ("host-mapped", "cpu")
