"""Tensor parallelism on the graph path: one captured step per rank, its collectives inside the graph.

Every rank of a TP group (engine/tp.py: rank 0 serves, ranks 1..M-1 follow, one process and one GPU
each) builds a `TPDecoder` over its `TPModel` shard and its `DecodeState`, which holds only its heads:
the fused step of gpu/decoder.py with

* after each mixer's and each FFN's last launch, the sum of the ranks' partial outputs: the
  o_proj / out_proj / down GEMVs store their partial unrounded in fp32 (gemv EPI_PARTIAL; the MoE
  launch adds its into the same zeroed buffer), `Collectives.all_reduce` sums it in fp32, and
  `residual_add` adds it to the residual with the one-device epilogue's rounding. The sum then differs
  from TP = 1's only in the order of its fp32 additions (closer than the eager TP engine, which sums
  bf16-rounded partials);
* the lm_head over the rank's vocabulary slice. Greedy without logprobs or a grammar mask: each rank
  packs its best (logit, id) into one 64-bit key, one max all-reduce of 8 bytes gives every rank the
  same token (kernels/tp.py), so no rank waits for another's choice. Sampling, logprobs and grammar
  masks: the logit slices are all-gathered, rank 0 runs the one-device tail (its sampler, its control
  ring, its host's masks) and broadcasts the token.

The communication is injected: `Collectives`, torch.distributed over the engine's group (NCCL on CUDA,
capturable in a CUDA graph; gloo on CPU, the interpreter tests), or `PeerCollectives`, one-shot kernels
over peer-mapped buffers (kernels/tp.py `peer_collective`: one launch per collective, no NCCL kernel;
the step's messages are a few KB, so latency is their cost). Peer memory is `PeerMemory`: between the
processes of a group, CUDA IPC on GPUs (peer access over NVLink) or named shared memory on CPU; within
one process (`PeerMemory.local`), plain buffers of one device, which lets two ranks share one GPU.

Lock step (`Lockstep`): rank 0's `TPRunner` is a `GraphRunner` whose replays are first announced in
two 64-bit words of shared host memory; a follower's `Follower` replays its own graph of the same
variant as soon as a replay is announced (a spin on the word, no message per token), so its replay k
is enqueued while rank 0's is, and the collectives inside the graphs pair up. A request costs one
queue message to each follower (variant, first token, position); its end is a third word. On CPU a
"graph" is the step's launches run directly (`_Direct`).
"""
from __future__ import annotations

import contextlib
import math
import os
import time
import uuid

import torch
import torch.distributed as dist

from nexrt_vllm.engine.errors import EngineError
from nexrt_vllm.engine.gpu.decoder import FusedDecoder
from nexrt_vllm.engine.gpu.runner import GraphRunner

_RUN_SHIFT = 40  # the end word: run << 40 | replays announced when the run ended (2^40: decades of tokens)
_RUNS = 1 << (63 - _RUN_SHIFT)  # run numbers wrap within a positive int64 (only consecutive ones are compared)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the name since torch 2.13)


class Collectives:
    """The step's collectives over a torch.distributed group of `size` ranks (None: the default
    group): NCCL on CUDA, capturable in a CUDA graph; gloo on CPU. Rank 0 is the group's rank 0."""
    kind = "group"  # (/capabilities: --tp-collectives)

    def __init__(self, size: int, rank: int, group=None):
        self.size, self.rank, self.group = size, rank, group

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)

    def all_reduce_residual(self, part: torch.Tensor, res: torch.Tensor) -> None:
        """res += bf16(the ranks' sum of part) with the one-device epilogue's rounding; part = 0."""
        from nexrt_vllm.engine.kernels.tp import residual_add
        self.all_reduce(part)
        residual_add(res, part)

    def max_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    def all_gather(self, out: torch.Tensor, part: torch.Tensor) -> None:
        """out [size * n] <- every rank's part [n], in rank order."""
        _all_gather(out, part, group=self.group)

    def broadcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, src=0, group=self.group)

    def check(self) -> None:
        """(torch.distributed raises on its own timeouts.)"""


class PeerMemory:
    """One rank's view of its group's peer memory: every rank's buffer (two halves of `half_bytes`)
    and signal array (int32 [programs * size]), as addresses this process can load and store, and the
    rank's own call counts and status. `allocate` makes a rank's own part, `share` a handle another
    process `open`s; `local` makes a whole group's views inside one process."""

    def __init__(self, rank: int, bufs: list[torch.Tensor], sigs: list[torch.Tensor], half_bytes: int,
                 programs: int):
        dev = bufs[rank].device
        self.rank, self.size, self.half_bytes, self.programs = rank, len(bufs), half_bytes, programs
        self.tensors = list(bufs) + list(sigs)  # the mappings stay while this view lives
        self.bufs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=dev)
        self.sigs = torch.tensor([g.data_ptr() for g in sigs], dtype=torch.int64, device=dev)
        self.epoch = torch.zeros(programs, dtype=torch.int32, device=dev)
        self.status = torch.zeros(1, dtype=torch.int32, device=dev)

    @staticmethod
    def capacity(max_elements: int) -> tuple[int, int]:
        """(half_bytes, programs) for messages of up to `max_elements` of at most 8 bytes."""
        from nexrt_vllm.engine.kernels.tp import PEER_BLOCK
        return 8 * max_elements, max(1, math.ceil(max_elements / PEER_BLOCK))

    @staticmethod
    def allocate(size: int, half_bytes: int, programs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """A rank's own (buffer, signal array), zeroed: device memory on CUDA; on CPU, named shared
        memory other processes can map (`share`)."""
        n_sig = programs * size
        if torch.device(device).type != "cpu":
            return (torch.zeros(2 * half_bytes, dtype=torch.uint8, device=device),
                    torch.zeros(n_sig, dtype=torch.int32, device=device))
        out = []
        for nbytes, dt in ((2 * half_bytes, torch.uint8), (4 * n_sig, torch.int32)):
            path = f"/dev/shm/nexrt-peer-{uuid.uuid4().hex}"
            with open(path, "wb") as f:
                f.truncate(nbytes)
            t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).view(dt)
            t.nexrt_path = path
            out.append(t)
        return out[0], out[1]

    @staticmethod
    def share(t: torch.Tensor):
        """A picklable handle on a tensor of `allocate` that another process `open`s (and may pass on)."""
        if t.device.type == "cpu":
            return ("file", t.nexrt_path, t.numel() * t.element_size(), str(t.dtype))
        from torch.multiprocessing.reductions import reduce_tensor
        return ("cuda", reduce_tensor(t))

    @staticmethod
    def open(handle) -> torch.Tensor:
        if handle[0] == "file":
            _, path, nbytes, dt = handle
            return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).view(getattr(torch, dt[6:]))
        rebuild, args = handle[1]
        return rebuild(*args)  # CUDA IPC: the peer GPU's memory, mapped with peer access

    @staticmethod
    def unlink(handle) -> None:
        """Remove a CPU handle's name once every rank has mapped it (the mappings stay)."""
        if handle[0] == "file":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(handle[1])

    def reset(self) -> None:
        """This rank's call counts, status and signal array back to zero (every rank of the group at once:
        a restart after waits that ran out, e.g. while the other rank's kernels were compiling)."""
        for t in (self.epoch, self.status, self.tensors[self.size + self.rank]):
            t.zero_()

    @classmethod
    def local(cls, size: int, max_elements: int, device) -> list["PeerMemory"]:
        """The views of all `size` ranks of a group inside one process (ranks as threads, one device)."""
        half, programs = cls.capacity(max_elements)
        parts = [cls.allocate(size, half, programs, device) for _ in range(size)]
        return [cls(r, [b for b, _ in parts], [g for _, g in parts], half, programs) for r in range(size)]


class PeerCollectives:
    """`Collectives` as one-shot kernels over `PeerMemory` (kernels/tp.py `peer_collective`): capturable
    (no host call), every wait bounded by `spin` flag reads; `check` raises if one ran out."""
    kind = "peer"

    def __init__(self, size: int, rank: int, mem: PeerMemory, spin: int = 1 << 22):
        if (mem.size, mem.rank) != (size, rank):
            raise EngineError(f"peer memory of rank {mem.rank} of {mem.size} given to rank {rank} of {size}")
        from nexrt_vllm.engine.kernels import tp as k_tp
        self.size, self.rank, self.mem, self.spin, self.k = size, rank, mem, spin, k_tp

    def _run(self, x: torch.Tensor, out: torch.Tensor, op: int) -> None:
        m, n = self.mem, x.numel()
        programs = math.ceil(n / self.k.PEER_BLOCK)
        if not x.is_contiguous() or n * x.element_size() > m.half_bytes or programs > m.programs:
            raise EngineError(f"a peer collective of {n} x {x.dtype} exceeds this group's peer memory "
                              f"({m.half_bytes} bytes, {m.programs} programs) or is not contiguous")
        self.k.peer_collective(x, out, op, m.bufs, m.sigs, m.epoch, m.status, self.rank,
                               m.half_bytes // x.element_size(), self.size, self.spin)

    def all_reduce(self, t: torch.Tensor) -> None:
        self._run(t, t, self.k.OP_SUM)

    def all_reduce_residual(self, part: torch.Tensor, res: torch.Tensor) -> None:
        """`Collectives.all_reduce_residual` in one launch."""
        self._run(part, res, self.k.OP_SUM_RESIDUAL)

    def max_reduce(self, t: torch.Tensor) -> None:
        self._run(t, t, self.k.OP_MAX)

    def all_gather(self, out: torch.Tensor, part: torch.Tensor) -> None:
        self._run(part, out, self.k.OP_GATHER)

    def broadcast(self, t: torch.Tensor) -> None:
        self._run(t, t, self.k.OP_BCAST)

    def check(self) -> None:
        """EngineError if a collective's wait ran out since the group started (the group is then out of
        step: a peer died or hangs); reads the device."""
        if int(self.mem.status.item()):
            raise EngineError(f"TP rank {self.rank}: a peer rank did not reach a collective within {self.spin} "
                              f"flag reads; the group is out of step")


class TPDecoder(FusedDecoder):
    """The fused step of one TP rank over its `TPModel` shard (engine/tp.py), its collectives inside."""

    def __init__(self, model, state, coll: Collectives, mode: str = "fused", tuning=None):
        tp, rank = getattr(model, "tp", 1), getattr(model, "rank", 0)
        if (tp, rank) != (coll.size, coll.rank):
            raise EngineError(f"a TP decoder over rank {rank} of {tp} needs that rank's collectives, "
                              f"got rank {coll.rank} of {coll.size}")
        super().__init__(model, state, mode, tuning)
        from nexrt_vllm.engine.kernels import tp as k_tp
        from nexrt_vllm.engine.tp import vocab_range
        self.k_tp, self.coll = k_tp, coll
        c, dev = self.cfg, state.device
        self.part = torch.zeros(c.hidden_size, dtype=torch.float32, device=dev)
        self.block_out, self.block_epi = self.part, self.k_gemv.EPI_PARTIAL
        self.key = torch.zeros(1, dtype=torch.int64, device=dev)
        self.vocab_offset, end = vocab_range(c.vocab_size, tp, rank)
        if mode == "fused":
            chunk = math.ceil(c.vocab_size / tp)
            self.lm_out = torch.full((chunk,), float("-inf"), dtype=torch.float32, device=dev)
            self.logits_all = torch.full((tp * chunk,), float("-inf"), dtype=torch.float32, device=dev)
            self.logits = self.logits_all[:c.vocab_size]
            self.n_part = -(-(end - self.vocab_offset) // self.lm_shape["block_n"])

    def _block(self, launches: list[tuple]) -> list[tuple]:
        return launches + [("tp_allreduce+residual", self._reduce, None)]

    def _reduce(self) -> None:
        self.coll.all_reduce_residual(self.part, self.res)

    def _select(self, pos, n_part, sample, logprobs, mask) -> None:
        if not (sample or logprobs or mask):
            if self.mode == "fused":  # (the eager mode's logits are whole on every rank already)
                self.k_tp.argmax_key(self.pmax, self.pidx, n_part, self.lm_out, self.vocab_offset, self.key)
                self.coll.max_reduce(self.key)
                self.k_tp.key_argmax(self.key, self.pmax, self.pidx)
                n_part = 1
            super()._select(pos, n_part, False, False, False)
            return
        if self.mode == "fused":
            self.coll.all_gather(self.logits_all, self.lm_out)
        if self.coll.rank == 0:
            super()._select(pos, n_part, sample, logprobs, mask)
        else:  # advances the position and the step; the token is rank 0's
            super()._select(pos, n_part, False, False, False)
        self.coll.broadcast(self.tok)


class _Direct:
    """A CPU stand-in for a captured step (the interpreter tests): a replay runs the step's launches."""

    def __init__(self, decoder: FusedDecoder, key: tuple[bool, bool, bool]):
        self.d, self.key = decoder, key

    def replay(self) -> None:
        self.d.launch(*self.key)


def _graph(runner: GraphRunner, key: tuple[bool, bool, bool]):
    """The runner's step graph of variant `key`: captured on CUDA, direct launches on CPU."""
    if runner.d.state.device.type == "cuda":
        return GraphRunner.capture(runner, *key)
    return runner.graphs.setdefault(key, _Direct(runner.d, key))


class Lockstep:
    """Rank 0's side of the lock step: shared words [replays announced, end of the last run] and a
    `send(ranks, *cmd)` to the followers' command queues (engine/tp.py `Group`)."""

    def __init__(self, words, send):
        self.words, self.send = words, send
        self.run = 0
        self.pending: tuple | None = None
        self.active = False

    def prepare(self, followers, key, first_token: int, seq_len: int) -> None:
        """The next run's setup, sent to `followers` with its first replay (a run that replays nothing
        is never announced, so a follower's run always ends)."""
        self.pending = (tuple(followers), key, first_token, seq_len)

    def announce(self) -> None:
        if self.pending is not None:
            followers, key, first, seq_len = self.pending
            self.pending = None
            self.run = (self.run + 1) % _RUNS
            self.send(followers, "run", self.run, int(self.words[0]), key, first, seq_len)
            self.active = True
        self.words[0] += 1

    def end(self) -> None:
        self.pending = None
        if self.active:
            self.words[1] = (self.run << _RUN_SHIFT) | int(self.words[0])
            self.active = False


class _Announced:
    """A step graph whose every replay is announced to the followers first."""

    def __init__(self, graph, lock: Lockstep):
        self.graph, self.lock = graph, lock

    def replay(self) -> None:
        self.lock.announce()
        self.graph.replay()


class TPRunner(GraphRunner):
    """Rank 0's graph runner at TP > 1: `GraphRunner` (its control ring, sampling, stop rules) over a
    `TPDecoder`, every replay announced to the followers (`Lockstep`)."""

    def __init__(self, decoder: TPDecoder, lock: Lockstep, followers):
        super().__init__(decoder)
        self.lock, self.followers = lock, tuple(followers)

    @property
    def masks(self) -> bool:
        # direct launches on CPU run a masked step before the host could write its mask
        return self.d.mem.masks and self.d.state.device.type == "cuda"

    def capture(self, sample: bool = False, logprobs: bool = False, mask: bool = False):
        if mask and not self.masks:
            raise EngineError(f"grammar masks need host-mapped control memory on a CUDA device (have "
                              f"{self.d.control} on {self.d.state.device})")
        return _Announced(_graph(self, (sample, logprobs, mask)), self.lock)

    def steps(self, first_token: int, max_new_tokens: int, *, temperature: float = 0.0, logprobs=None,
              constraint=None, **kw):
        key = (temperature > 0, logprobs is not None, constraint is not None)
        self.lock.prepare(self.followers, key, first_token, self.d.state.seq_len)
        try:
            yield from super().steps(first_token, max_new_tokens, temperature=temperature, logprobs=logprobs,
                                     constraint=constraint, **kw)
        finally:
            self.lock.end()
        self.d.coll.check()

    def _sync(self) -> None:
        if self.d.state.device.type == "cuda":
            super()._sync()

    @contextlib.contextmanager
    def lead(self, key: tuple[bool, bool, bool] = (False, False, False), first_token: int = 0):
        """Raw replays for benchmarks: yields variant `key`'s graph, whose replays the followers follow
        (from `first_token` at the device position's state.seq_len); no tokens are read or counted."""
        self.lock.prepare(self.followers, key, first_token, self.d.state.seq_len)
        try:
            yield self.capture(*key)
        finally:
            self._sync()
            self.lock.end()
        self.d.coll.check()


class Follower(GraphRunner):
    """A follower rank's runner: its step graphs, replayed as rank 0 announces them (`follow`)."""

    @property
    def masks(self) -> bool:
        return True  # a follower's step never reads a mask: rank 0 chooses masked tokens

    def capture(self, sample: bool = False, logprobs: bool = False, mask: bool = False):
        return _graph(self, (sample, logprobs, mask))

    def follow(self, words, run: int, start: int, key, first_token: int, seq_len: int, alive) -> int:
        """Replay variant `key` from `first_token` at `seq_len` once per replay rank 0 announces in run
        `run` (its first announced as replay `start` + 1), until the run's end; returns the replays.
        `alive()` is asked about once a second while nothing is announced (False: give up)."""
        g, d, st = self.capture(*key), self.d, self.d.state
        d.tok.fill_(first_token)
        st.position.fill_(seq_len)
        n, check = start, time.monotonic() + 1.0
        try:
            while True:
                # The announced count first, then the end word: rank 0 writes a run's end before it
                # announces the next run's replays, so a count read before an unended word is this run's.
                announced, ended = int(words[0]), int(words[1])
                limit = ended & ((1 << _RUN_SHIFT) - 1) if ended >> _RUN_SHIFT == run else announced
                if n < limit:
                    g.replay()
                    n += 1
                elif ended >> _RUN_SHIFT == run:
                    break
                else:
                    time.sleep(0)
                    if time.monotonic() > check:
                        if not alive():
                            raise EngineError(f"rank 0 is gone during run {run}")
                        check = time.monotonic() + 1.0
        finally:
            if st.device.type == "cuda":
                self._sync()
            st.seq_len = seq_len + n - start
        d.coll.check()
        return n - start
