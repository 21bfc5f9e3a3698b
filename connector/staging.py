"""Staged sending from GPU memory, for a transport that cannot read it (e.g. Mooncake's non-CUDA
wheel): each batch of page writes is copied device -> pinned host on a side stream, once the pages
are final (the CUDA event recorded when vLLM handed them over), then sent from host memory.

The pinned pool is registered with the transport once; batches take ranges of it and give them
back when their write returned, so concurrent hand-offs never share bytes. A batch larger than the
pool goes in pool-sized pieces.
"""
from __future__ import annotations

import threading
from contextlib import nullcontext as _nullcontext
from typing import Sequence

import torch

from nexrt_vllm.handoff.transport import Write, coalesce


class StagingTimeout(TimeoutError):
    pass


class _Ranges:
    """First-fit allocator over [0, size) with a bounded wait."""

    def __init__(self, size: int):
        self.size = size
        self._free = [(0, size)]  # sorted, disjoint (start, length)
        self._cv = threading.Condition()

    def take(self, n: int, timeout: float) -> int:
        with self._cv:
            got = self._cv.wait_for(lambda: self._fit(n) is not None, timeout)
            if not got:
                raise StagingTimeout(f"no {n} B free in the {self.size} B staging pool within {timeout}s")
            i = self._fit(n)
            start, length = self._free[i]
            if length == n:
                del self._free[i]
            else:
                self._free[i] = (start + n, length - n)
            return start

    def give(self, start: int, n: int) -> None:
        with self._cv:
            self._free.append((start, n))
            self._free.sort()
            merged = []
            for s, ln in self._free:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + ln)
                else:
                    merged.append((s, ln))
            self._free = merged
            self._cv.notify_all()

    def _fit(self, n: int):
        return next((i for i, (_, ln) in enumerate(self._free) if ln >= n), None)


class PinnedStager:
    def __init__(self, storages: Sequence[torch.UntypedStorage], sender, nbytes: int, timeout: float):
        self._src = []  # (base address, size, flat uint8 device view)
        for st in storages:
            flat = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (st.nbytes(),), (1,))
            self._src.append((st.data_ptr(), st.nbytes(), flat))
        self._cuda = any(flat.is_cuda for _, _, flat in self._src)
        self.pool = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda)
        self._addr = self.pool.data_ptr()
        sender.register(self._addr, nbytes, "host")
        self._ranges = _Ranges(nbytes)
        self._timeout = timeout
        self._local = threading.local()

    def write(self, transfer, writes: Sequence[Write], ready) -> None:
        """``writes``: (device address, remote offset, nbytes); ``ready``: CUDA event after which the
        pages are final (None: already final). Returns when every byte was sent."""
        for piece in self._pieces(coalesce(writes)):
            total = sum(w[2] for w in piece)
            start = self._ranges.take(total, self._timeout)
            try:
                staged, off = [], start
                stream = self._stream() if self._cuda else None
                with torch.cuda.stream(stream) if stream is not None else _nullcontext():
                    if ready is not None:
                        stream.wait_event(ready)
                    for loc, rem, n in piece:
                        self.pool[off: off + n].copy_(self._view(loc, n), non_blocking=stream is not None)
                        staged.append((self._addr + off, rem, n))
                        off += n
                if stream is not None:
                    stream.synchronize()
                transfer.write(staged)
            finally:
                self._ranges.give(start, total)

    def _pieces(self, writes: list[Write]):
        """Batches of at most the pool's size (a single write larger than it is split)."""
        cap = self._ranges.size
        piece, used = [], 0
        for loc, rem, n in writes:
            while n > 0:
                k = min(n, cap - used)
                piece.append((loc, rem, k))
                used += k
                loc, rem, n = loc + k, rem + k, n - k
                if used == cap:
                    yield piece
                    piece, used = [], 0
        if piece:
            yield piece

    def _view(self, addr: int, n: int) -> torch.Tensor:
        for base, size, flat in self._src:
            if base <= addr and addr + n <= base + size:
                return flat[addr - base: addr - base + n]
        raise ValueError(f"page [{addr:#x}, +{n}) is outside vLLM's registered KV cache")

    def _stream(self):
        s = getattr(self._local, "stream", None)
        if s is None:
            s = self._local.stream = torch.cuda.Stream(device=self._src[0][2].device)
        return s
