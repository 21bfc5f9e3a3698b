"""Two TP ranks on one GPU: each rank's sharded step captured in its own CUDA graph with the one-shot
collectives inside (gpu/tp.py `PeerCollectives` over `PeerMemory.local`: both ranks' buffers in the one
device's memory), the two graphs replayed on two streams at once; their greedy tokens must equal the
TP = 1 graph path's (`Engine.use_graph`) token for token, on both ranks, from TP = 1's prefill state
re-sharded (node/reshard.py), on the trained tiny checkpoints of the three families, with PDL on and off.
What it proves without a second GPU: the sharded step, the collectives' kernels (flags, halves, rank-order
sums, the greedy key's max) and their capture; NCCL and NVLink wait for a multi-GPU host (tp_check.py,
tests/gpu/test_tp_graph_cuda.py).

    python benchmarks/checks/tp_one_gpu.py --checkpoints DIR --json OUT/tp_one_gpu.json [--tokens 256]

DIR/<family>: the trained tiny checkpoints with MTP heads (stored in the repository for all three families;
the head is not used), copied there if missing (testing/stored.py `place`). Exit status 1 if any
family's tokens differ or a collective's wait ran out (nexrt_vllm.bench.checks).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

from nexrt_vllm.bench.checks import finish, record, write

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
SPIN = 1 << 16  # flag reads per wait (~0.1 s): a wait that runs out is a failure, not a hang


def run_family(path: str, tokens: int, pdl: bool) -> dict:
    from nexrt_vllm.engine import Engine, SamplingParams
    from nexrt_vllm.engine.gpu.decoder import FusedDecoder
    from nexrt_vllm.engine.gpu.runner import GraphRunner
    from nexrt_vllm.engine.gpu.tp import PeerCollectives, PeerMemory, TPDecoder
    from nexrt_vllm.engine.gpu.tuning import Tuning
    from nexrt_vllm.engine.tp import _build
    from nexrt_vllm.node.reshard import node_shards, split_state
    from nexrt_vllm.testing.recipes import periodic_prompt

    prompt = periodic_prompt(40, seed=1)
    tuning = Tuning(pdl=pdl)
    max_len = len(prompt) + tokens + 8
    one = Engine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_seq_len=max_len, progress=False)
    one.graph = GraphRunner(FusedDecoder(one.model, one.state, "fused", tuning))  # captures greedy on first use
    first = int(one.prefill(prompt).argmax())
    n0, snap = one.export_state()
    want = list(one.stream(first, SamplingParams(max_tokens=tokens + 1, ignore_eos=True)))[:tokens]
    cfg = one.config

    spec = {"path": path, "config": None, "dtype": "bfloat16", "max_seq_len": max_len, "load_format": "auto"}
    engs = [_build(spec, 2, r, None, "cuda:0") for r in range(2)]
    mems = PeerMemory.local(2, max(cfg.hidden_size, math.ceil(cfg.vocab_size / 2)), "cuda:0")
    decs = [TPDecoder(e.model, e.state, PeerCollectives(2, r, mems[r], spin=SPIN), "fused", tuning)
            for r, e in enumerate(engs)]
    shards = split_state(cfg, {k: v.cpu() for k, v in snap.items()}, node_shards(cfg, 2))
    streams = [torch.cuda.Stream() for _ in range(2)]
    key = (False, False, False)

    def reset():
        for e, d, sh in zip(engs, decs, shards):
            e.import_state(n0, {k: v.cuda() for k, v in sh.items()})
            d.tok.fill_(first)
            d.state.position.fill_(n0)
        torch.cuda.synchronize()

    def both(fn):  # enqueue rank 0's work, then rank 1's: the launches are asynchronous, so they pair up
        for r in range(2):
            with torch.cuda.stream(streams[r]):
                fn(r)

    # first launch: compiles every kernel while the other rank's are not enqueued yet, so its waits may run
    # out; then every rank's call counts, flags and status start again from zero
    reset()
    both(lambda r: decs[r].launch(*key))
    torch.cuda.synchronize()
    for m in mems:
        m.reset()
    reset()
    both(lambda r: decs[r].launch(*key))  # the warm-up the capture needs, now without compiles
    torch.cuda.synchronize()
    warm_ok = all(int(m.status) == 0 for m in mems)
    reset()
    graphs = []
    for r in range(2):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=streams[r]):
            decs[r].launch(*key)
        graphs.append(g)
    reset()
    got = torch.zeros(2, tokens, dtype=torch.int64, device="cuda")
    t0 = time.perf_counter()
    for k in range(tokens):
        def replay(r):
            graphs[r].replay()
            got[r, k].copy_(decs[r].tok.view(-1)[0])
        both(replay)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / tokens
    status = [int(m.status) for m in mems]
    ranks = got.tolist()
    first_diff = next((i for i, (a, b) in enumerate(zip(ranks[0], want)) if a != b), None)
    return {"tokens": tokens, "tp1": want[:16], "rank0": ranks[0][:16], "equal_tp1": ranks[0] == want,
            "ranks_equal": ranks[0] == ranks[1], "first_diff": first_diff, "status": status, "warmup_ok": warm_ok,
            "pair_step_ms": round(ms, 4), "pdl": pdl}


def main(argv=None) -> int:
    from nexrt_vllm.testing import stored
    from nexrt_vllm.testing.recipes import TRAINED_MTP

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoints", required=True)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tp_one_gpu needs a CUDA device", file=sys.stderr)
        return 2
    report = {"device": torch.cuda.get_device_name(), "tokens": a.tokens, "spin": SPIN, "results": {}}
    for pdl in (True, False):
        for fam in a.families:
            path = os.path.join(a.checkpoints, fam)
            stored.place(path, fam, "bfloat16", TRAINED_MTP[fam])
            name = f"{fam}/pdl{int(pdl)}"
            try:
                r = run_family(path, a.tokens, pdl)
            except Exception as e:  # noqa: BLE001 - recorded as this case's failure; the others still run
                r = {"error": f"{type(e).__name__}: {e}"}
            report["results"][name] = r
            record(report, name, r.get("equal_tp1") and r.get("ranks_equal") and r.get("status") == [0, 0])
            print(name, {k: v for k, v in r.items() if k not in ("tp1", "rank0")}, flush=True)
            write(report, a.json)  # what ran so far, should a later case not finish
    return finish(report, a.json)


if __name__ == "__main__":
    sys.exit(main())
