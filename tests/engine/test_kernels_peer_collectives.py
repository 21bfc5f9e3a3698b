"""The one-shot collectives over peer memory (kernels/tp.py `peer_collective`, gpu/tp.py `PeerCollectives`)
through the Triton interpreter: this process is rank 0, a second process rank 1, their buffers named shared
memory (`PeerMemory` on CPU). Sums come out in rank order, the same bits on both ranks, also added to a bf16
residual as `residual_add` rounds; max, gather and broadcast give every rank the same result; calls
alternate the buffer halves (data of call c + 1 differs from call c's) across the int32 wrap of the call
count; a peer that never comes sets the status, and `check` raises instead of hanging.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from nexrt_vllm.engine import kernels
from nexrt_vllm.engine.errors import EngineError
from nexrt_vllm.engine.gpu.tp import PeerCollectives, PeerMemory

kernels.load(interpret=True)
torch.set_num_threads(1)

N, M, CALLS = 2500, 1500, 4  # 3 and 2 programs of 1024, the last ones partial

_RANK = r"""
import json, sys, torch
torch.set_num_threads(1)
from nexrt_vllm.engine import kernels
kernels.load(interpret=True)
from nexrt_vllm.engine.gpu.tp import PeerCollectives, PeerMemory
sys.path.insert(0, sys.argv[3])
from test_kernels_peer_collectives import run
spec = json.loads(sys.argv[1])
mem = PeerMemory(1, [PeerMemory.open(h) for h in spec["bufs"]], [PeerMemory.open(h) for h in spec["sigs"]],
                 spec["half"], spec["programs"])
mem.epoch.fill_(spec["epoch"])
open(sys.argv[2] + ".ready", "w").close()
torch.save(run(PeerCollectives(2, 1, mem, spin=spec["spin"])), sys.argv[2])
"""


def _inputs(rank: int, c: int):
    g = torch.Generator().manual_seed(1000 * c + rank)
    return (torch.randn(N, generator=g), torch.randint(-2**62, 2**62, (1,), generator=g),
            torch.randn(M, generator=g), torch.tensor([10 * c + rank]), torch.randn(N, generator=g),
            torch.randn(N, generator=torch.Generator().manual_seed(7 + c)).to(torch.bfloat16))


def run(coll) -> dict:
    """CALLS rounds of the five collectives on this rank's inputs."""
    out = {}
    for c in range(CALLS):
        x, key, part, tok, p, res = _inputs(coll.rank, c)
        gathered = torch.full((2 * M,), float("nan"))
        coll.all_reduce(x)
        coll.max_reduce(key)
        coll.all_gather(gathered, part)
        coll.broadcast(tok)
        coll.all_reduce_residual(p, res)
        out[c] = (x, key, gathered, tok, p, res)
    out["status"] = int(coll.mem.status)
    return out


def _group(epoch: int, spin: int = 1 << 20):
    half, programs = PeerMemory.capacity(max(N, M))
    parts = [PeerMemory.allocate(2, half, programs, "cpu") for _ in range(2)]
    handles = {"bufs": [PeerMemory.share(b) for b, _ in parts], "sigs": [PeerMemory.share(g) for _, g in parts],
               "half": half, "programs": programs, "epoch": epoch, "spin": spin}
    mem = PeerMemory(0, [b for b, _ in parts], [g for _, g in parts], half, programs)
    mem.epoch.fill_(epoch)
    return mem, handles


@pytest.mark.parametrize("epoch", [0, 2**31 - 3])
def test_two_ranks_agree_on_every_collective(tmp_path, epoch):
    mem, handles = _group(epoch)
    out1 = tmp_path / "rank1.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    peer = subprocess.Popen([sys.executable, "-c", _RANK, json.dumps(handles), str(out1), os.path.dirname(__file__)],
                            env=env)
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(f"{out1}.ready"):  # its imports done: the waits are for its kernels only
            assert peer.poll() is None and time.monotonic() < deadline, "rank 1 did not start"
            time.sleep(0.1)
        mine = run(PeerCollectives(2, 0, mem, spin=handles["spin"]))
        assert peer.wait(timeout=600) == 0
    finally:
        peer.kill()
        for h in handles["bufs"] + handles["sigs"]:
            PeerMemory.unlink(h)
    theirs = torch.load(out1)
    assert mine["status"] == theirs["status"] == 0
    for c in range(CALLS):
        (x0, k0, p0, t0, q0, res), (x1, k1, p1, t1, q1, _) = _inputs(0, c), _inputs(1, c)
        for got in (mine[c], theirs[c]):
            assert torch.equal(got[0], x0 + x1), c  # fp32, rank 0's plus rank 1's: the same bits on both
            assert torch.equal(got[1], torch.maximum(k0, k1)), c
            assert torch.equal(got[2], torch.cat([p0, p1])), c
            assert torch.equal(got[3], t0), c
            assert not got[4].any(), c  # the partial zeroed for the next block
            # the residual add of kernels/tp.py residual_add: bf16(res + bf16(sum)), round to nearest even
            assert torch.equal(got[5], (res.float() + (q0 + q1).to(torch.bfloat16).float()).to(torch.bfloat16)), c
    assert int(mem.epoch[0]) == (epoch + 5 * CALLS + 2**31) % 2**32 - 2**31  # five collectives a round


def test_a_peer_that_never_comes_sets_the_status():
    mem, handles = _group(0, spin=200)
    try:
        coll = PeerCollectives(2, 0, mem, spin=200)
        coll.check()
        t = torch.ones(8)
        coll.all_reduce(t)  # rank 1 never calls: the wait runs out
        with pytest.raises(EngineError, match="did not reach a collective within 200"):
            coll.check()
    finally:
        for h in handles["bufs"] + handles["sigs"]:
            PeerMemory.unlink(h)


def test_messages_past_the_peer_memory_are_refused():
    mem, handles = _group(0)
    try:
        coll = PeerCollectives(2, 0, mem)
        with pytest.raises(EngineError, match="exceeds this group's peer memory"):
            coll.all_reduce(torch.zeros(4 * max(N, M)))
        with pytest.raises(EngineError, match="rank 0 of 2 given to rank 1 of 2"):
            PeerCollectives(2, 1, mem)
        assert int(mem.epoch.sum()) == 0  # nothing launched
    finally:
        for h in handles["bufs"] + handles["sigs"]:
            PeerMemory.unlink(h)
