"""The logprob / grammar-mask kernels of the captured step (kernels/sampling.py: `tail_kernel` and
the finish's logprob part) against torch, through the Triton interpreter.

Reference: vLLM's raw_logprobs (log_softmax of the fp32 logits, after the grammar's bitmask) and
torch.topk. The bitmask is xgrammar's int32 layout, bit t % 32 of word t // 32. The flag
protocol: the tail waits until the host's flag reaches the step; a mask that never comes leaves
the step's number in `status` and the finish publishes INVALID_TOKEN instead of a token.
With NEXRT_KERNEL_DEVICE=cuda (benchmarks/checks/gpu_check.py) the same tests run the compiled kernels,
the flag and the masks then in device memory (the host-mapped case runs in benchmarks/outputs_bench.py).
"""
import os

import pytest
import torch

from nexrt_vllm.engine import kernels

DEV = os.environ.get("NEXRT_KERNEL_DEVICE", "cpu")
kernels.load(interpret=DEV == "cpu")
from nexrt_vllm.engine.kernels import sampling as S  # noqa: E402

torch.set_num_threads(1)
RING = 64


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    v = allowed.numel()
    words = torch.zeros((v + 31) // 32, dtype=torch.int64)
    t = torch.arange(v)[allowed]
    words.index_add_(0, t // 32, torch.ones_like(t) << (t % 32))
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # two's complement into int32


class Step:
    """The buffers of one decode step's tail + finish, for a vocabulary of V."""

    def __init__(self, v: int, chunk: int):
        self.v, self.chunk = v, chunk
        self.nt = -(-v // chunk)
        km, i32, i64 = S.KMAX, dict(dtype=torch.int32, device=DEV), dict(dtype=torch.int64, device=DEV)
        self.tmax, self.tsum = torch.zeros(self.nt, device=DEV), torch.zeros(self.nt, device=DEV)
        self.tidx = torch.zeros(self.nt, **i32)
        self.topv, self.topi = torch.zeros(self.nt * km, device=DEV), torch.zeros(self.nt * km, **i32)
        self.masks = torch.full((2, (v + 31) // 32), -1, **i32)
        self.step = torch.zeros(1, **i64)
        self.flag = torch.zeros(1, **i64)
        self.status = torch.full((1,), -1, **i64)
        self.k = torch.zeros(1, **i32)
        self.tok, self.pos = torch.zeros(1, **i64), torch.zeros(1, **i64)
        self.ring = torch.full((RING,), -1, **i64)
        self.lpv, self.lpi = torch.zeros(RING, km + 1, device=DEV), torch.zeros(RING, km, **i32)

    def run(self, logits, k, allowed=None, write=False, spin=4):
        """One step: the mask (if any) for step `step + 1`, published by the flag; tail; finish."""
        want = int(self.step) + 1
        mask = allowed is not None
        logits = logits.to(DEV)
        if mask:
            self.masks[want % 2] = _bitmask(allowed).to(DEV)
            self.flag.fill_(want)
        self.k.fill_(k)
        n = S.tail(logits, self.step, self.flag, self.masks, self.k, self.status, self.tmax, self.tidx, self.tsum,
                   self.topv, self.topi, mask=mask, topk=True, write=write, chunk=self.chunk, spin=spin)
        assert n == self.nt
        S.finish(self.tmax, self.tidx, n, self.tok, self.pos, self.step, self.ring, RING,
                 lp=(logits, self.tmax, self.tsum, n, self.topv, self.topi, self.k, self.lpv, self.lpi),
                 status=self.status if mask else None)
        v = int(self.ring[(want - 1) % RING])
        assert v >> 32 == want
        slot = (want - 1) % RING
        self.logits = logits.cpu()
        return (v & 0xFFFFFFFF, float(self.lpv[slot, 0]), self.lpv[slot, 1:k + 1].cpu(),
                self.lpi[slot, :k].tolist())


@pytest.mark.parametrize("v,chunk,k", [(1000, 256, 7), (384, 128, 20), (500, 64, 0), (2048, 512, 1)])
@pytest.mark.parametrize("masked", [False, True])
def test_tail_and_finish_match_log_softmax(v, chunk, k, masked):
    g = torch.Generator().manual_seed(v + k)
    logits = torch.randn(v, generator=g) * 4
    logits[7] = logits[v - 3] = logits.max() + 1  # a tie for the greedy choice: the lower id wins
    allowed = (torch.rand(v, generator=g) < 0.4) | (torch.arange(v) == 7) if masked else None
    s = Step(v, chunk)
    for step in range(3):  # the ring and the mask slots advance with the step counter
        x = logits.roll(step * 5) if step else logits
        ref_logits = x if allowed is None else x.masked_fill(~allowed, float("-inf"))
        tok, lp, top_v, top_i = s.run(x.clone(), k, allowed)
        ref = torch.log_softmax(ref_logits, -1)
        assert tok == int(torch.argmax(ref_logits))
        assert abs(lp - float(ref[tok])) < 1e-5
        rv, ri = torch.sort(ref, descending=True, stable=True)  # ties: lower id first, as the kernel
        assert top_i == ri[:k].tolist()
        assert torch.allclose(top_v, rv[:k], atol=1e-5)
        assert int(s.tok) == tok and int(s.pos) == step + 1
    assert int(s.status) == -1


def test_masked_logits_stored_back_for_the_sampler():
    """The sampling graph sorts the logits after the tail: with `write` they are the masked ones."""
    v = 300
    logits = torch.randn(v, generator=torch.Generator().manual_seed(1))
    allowed = torch.zeros(v, dtype=torch.bool)
    allowed[[3, 31, 32, 250, 299]] = True
    s = Step(v, 128)
    tok, lp, top_v, top_i = s.run(logits.clone(), 20, allowed, write=True)
    x = s.logits  # the logits buffer after the step
    assert torch.equal(x, logits.masked_fill(~allowed, float("-inf")))
    # only the five allowed tokens are candidates: the rest of the top 20 is empty (-inf, no id)
    ref = torch.log_softmax(x, -1)
    assert sorted(top_i[:5]) == [3, 31, 32, 250, 299] and tok == top_i[0]
    assert torch.allclose(top_v[:5], torch.topk(ref, 5).values, atol=1e-5)
    assert top_i[5:] == [2**31 - 1] * 15 and torch.isinf(top_v[5:]).all()
    assert abs(float(torch.logsumexp(ref, 0))) < 1e-5  # the five logprobs sum to one


def test_missing_mask_publishes_invalid_token():
    """The host never raises the flag: the step gives up after `spin` reads, says so in `status`, and
    the finish publishes INVALID_TOKEN (the next replay still embeds a valid id)."""
    v = 256
    s = Step(v, 128)
    s.k.fill_(3)
    logits = torch.randn(v, device=DEV)
    n = S.tail(logits, s.step, s.flag, s.masks, s.k, s.status, s.tmax, s.tidx, s.tsum, s.topv, s.topi,
               mask=True, topk=False, write=False, chunk=128, spin=3)
    assert int(s.status) == 1
    S.finish(s.tmax, s.tidx, n, s.tok, s.pos, s.step, s.ring, RING, status=s.status)
    assert int(s.ring[0]) == (1 << 32) | S.INVALID_TOKEN and int(s.tok) == 0
