"""The graph runner: one captured CUDA graph per decode step, pipelined replays.

`GraphRunner` captures a `FusedDecoder` step (embedding, every layer, final norm, lm_head, token
selection, control publication) into one CUDA graph, so a generated token costs exactly one graph
replay. The host enqueues replay k+1 before it waits for token k (spinning on the control ring,
gpu/control.py, no device sync), does stop detection itself, and discards the one replay that ran
past a stop.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator

import torch

from nexrt_vllm.engine.decode_loop import DecodeLoop
from nexrt_vllm.engine.errors import EngineError
from nexrt_vllm.engine.gpu.control import RING, wait_record
from nexrt_vllm.engine.gpu.decoder import FusedDecoder


def capture_graph(launch: Callable[[], None], live: Iterable[torch.Tensor] = (),
                  clear: Iterable[torch.Tensor] = ()) -> torch.cuda.CUDAGraph:
    """`launch` captured into a CUDA graph without a trace: one warm-up run on a side stream (compiles the
    kernels, the allocator settles), the tensors of `live` (what a run mutates) put back, the capture,
    `live` put back again, then the tensors of `clear` filled with -1 (the control rings and words the
    warm-up wrote: the restored step counter publishes its step again)."""
    saved = [(t, t.clone()) for t in {id(t): t for t in live}.values()]

    def restore() -> None:
        for t, c in saved:
            t.copy_(c)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        launch()
        torch.cuda.synchronize()
        restore()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            launch()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    restore()
    for t in clear:
        t.fill_(-1)
    torch.cuda.synchronize()
    return g


class GraphRunner:
    """One captured CUDA graph per decode step over a `FusedDecoder`, one graph per variant
    (sample, logprobs, mask): logprobs and grammar masks add the tail launch and a longer finish to
    the plain greedy or sampling step."""

    VARIANTS = tuple((s, lp, m) for s in (False, True) for lp in (False, True) for m in (False, True))

    def __init__(self, decoder: FusedDecoder):
        self.d = decoder
        self.graphs: dict[tuple[bool, bool, bool], torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self.loop: DecodeLoop | None = None  # the last `stream_steps` request's

    @property
    def finish_reason(self) -> str | None:
        """Why the last `stream_steps` ended ("stop" | "length"); None before it ended."""
        return self.loop.finish_reason if self.loop is not None else None

    @property
    def masks(self) -> bool:
        """Whether grammar-constrained requests can run on the graph (host-mapped control memory)."""
        return self.d.mem.masks

    def capture(self, sample: bool = False, logprobs: bool = False, mask: bool = False) -> torch.cuda.CUDAGraph:
        """One variant's step graph, compiled and captured on the first call (`use_graph` captures every
        variant at start-up, so no request pays for it)."""
        key = (sample, logprobs, mask)
        if key not in self.graphs:
            if mask and not self.masks:
                raise EngineError(f"grammar masks need host-mapped control memory (have {self.d.control})")
            d = self.d
            flag = d.mem.host["flag"]
            if mask:
                flag.fill_(1 << 62)  # the warm-up step must not wait for a mask
                torch.cuda.synchronize()
            self.graphs[key] = capture_graph(lambda: d.launch(*key), self._live(), (d.ring, d.ring_host, d.mask_status))
            flag.fill_(int(d.step.item()))  # no later step has a mask yet
        return self.graphs[key]

    def _live(self) -> list[torch.Tensor]:
        # every tensor a step mutates
        d = self.d
        return [d.state.position, d.tok, d.step, d.res] + d.state.buffers()

    def stream(self, first_token: int, params, constraint=None) -> Iterator[int]:
        """The token ids of `stream_steps`."""
        return (rec.token for rec in self.stream_steps(first_token, params, constraint))

    def stream_steps(self, first_token: int, params, constraint=None, loop: DecodeLoop | None = None) -> Iterator:
        """`Engine.steps`'s contract (docs/ARCHITECTURE.md §1) on the graph path: the state holds N
        tokens and token N is `first_token` (already accepted by `constraint`); yields `Sampled`
        records of the following tokens until `loop` (decode_loop.py; None: a new one for `params`)
        ends the request, whose `finish_reason` this runner's is."""
        st = self.d.state
        loop = self.loop = loop or DecodeLoop(params, self.d.cfg.eos_token_ids, constraint)
        if not loop.start(first_token):
            return
        seed = params.seed if params.seed is not None else random.getrandbits(31)
        for rec in self.steps(first_token, loop.room(st), temperature=params.temperature, top_p=params.top_p,
                              top_k=max(params.top_k, 0), seed=seed, stop_token_ids=loop.stop_ids,
                              logprobs=params.logprobs, constraint=constraint):
            yield rec
            if loop.emit(rec.token):
                return
        loop.end()

    def generate(self, first_token: int, max_new_tokens: int, **kw) -> Iterator[int]:
        """The token ids of `steps` (same arguments)."""
        return (rec.token for rec in self.steps(first_token, max_new_tokens, **kw))

    def steps(self, first_token: int, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
              top_k: int = 0, seed: int = 0, stop_token_ids=(), logprobs: int | None = None, constraint=None,
              timeout_s: float = 60.0):
        """Yield a `Sampled` per token after `first_token` (the token at position state.seq_len) until a
        stop id, the grammar's end or the limit.

        The state advances on the device; afterwards `state.seq_len` counts every replay that ran,
        including the one overrun replay after a stop (its token is discarded, its state write stays).
        With `constraint` (which has accepted `first_token`), the mask of step k+1 is written as soon
        as token k is read, while the device already runs step k+1's layers; the step waits for it
        only at its tail.
        """
        from nexrt_vllm.engine.kernels.sampling import INVALID_TOKEN
        from nexrt_vllm.engine.sampling import Sampled

        d, st = self.d, self.d.state
        if max_new_tokens <= 0:
            return
        if st.seq_len + max_new_tokens > st.max_seq_len:
            raise EngineError(f"seq_len {st.seq_len} + {max_new_tokens} new tokens exceeds max_seq_len "
                              f"{st.max_seq_len}")
        sample = temperature > 0
        if sample and not (0.0 < top_p <= 1.0):
            raise EngineError(f"top_p must be in (0, 1], got {top_p}")
        lp, mask = logprobs is not None, constraint is not None
        g = self.capture(sample, lp, mask)
        d.params.copy_(torch.tensor([temperature if sample else 1.0, top_p, float(top_k)]))
        d.seed.fill_(seed)
        d.tok.fill_(first_token)
        d.state.position.fill_(st.seq_len)
        if lp:
            d.lp_k.fill_(logprobs)
        base = int(d.step.item())
        if mask:
            self._publish_mask(constraint, base + 1)
        stops = set(stop_token_ids)
        ring, vocab = d.ring_host, d.cfg.vocab_size
        done = 0
        launched = 0
        try:
            g.replay()
            launched = 1
            while done < max_new_tokens:
                if launched < max_new_tokens:
                    g.replay()  # k+1 in flight before we read k
                    launched += 1
                want = base + done + 1
                tok = wait_record(ring, want, timeout_s, "decode step")
                if tok == INVALID_TOKEN:
                    raise EngineError(f"decode step {want}: its grammar mask did not arrive within "
                                      f"{d.t.mask_spin} flag reads")
                done += 1
                rec = Sampled(tok, *self._logprobs((want - 1) % RING, logprobs, vocab)) if lp else Sampled(tok)
                end = tok in stops
                if mask:
                    constraint.accept(tok)
                    end = end or constraint.terminated
                    if not end and done < max_new_tokens:
                        self._publish_mask(constraint, want + 1)
                yield rec
                if end:
                    break
        finally:
            if mask:
                d.mem.host["flag"].fill_(base + launched)  # releases a replay waiting for a mask that will not come
            self._sync()
            self.replays += launched
            st.seq_len += launched

    def _sync(self) -> None:
        torch.cuda.current_stream().synchronize()

    def _publish_mask(self, constraint, step: int) -> None:
        # The mask first, then the flag: x86 keeps the two stores in order for the device's reads.
        host = self.d.mem.host
        constraint.fill(host["masks"][step % 2:step % 2 + 1])
        host["flag"][0] = step

    def _logprobs(self, slot: int, k: int, vocab: int) -> tuple[float, tuple[tuple[int, float], ...]]:
        host = self.d.mem.host
        vals = host["lpv"][slot, :k + 1].tolist()
        ids = host["lpi"][slot, :k].tolist()
        return vals[0], tuple((i, x) for i, x in zip(ids, vals[1:]) if i < vocab)
