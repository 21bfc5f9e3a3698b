"""Launch-shape sweep of the FP8 kernels on the GPU (one shape built once, then every candidate
graph.Tuning timed per kernel group at one context, as decode_bench's kernel_groups does).

Candidates change one Tuning field at a time from the defaults; the JSON holds every candidate's
group times and, per field, the value with the least summed time of the groups it moves.

    python3 benchmarks/fp8_sweep.py --shapes 2b,35b --context 8192 --json $OUT/fp8_sweep.json
"""
import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_bench as D  # noqa: E402

# field -> candidate values (the first is compared against the defaults too)
CANDIDATES = {
    "gemv_fp8": [((4096, 2, 2048, 4), (10000, 8, 512, 4), (1 << 62, 16, 512, 4)),
                 ((4096, 4, 2048, 4), (10000, 8, 1024, 4), (1 << 62, 16, 1024, 4)),
                 ((4096, 2, 2048, 8), (10000, 8, 1024, 8), (1 << 62, 16, 1024, 8)),
                 ((4096, 4, 1024, 4), (10000, 16, 512, 4), (1 << 62, 32, 512, 4)),
                 ((4096, 2, 1024, 2), (10000, 4, 1024, 4), (1 << 62, 8, 1024, 4)),
                 ((4096, 1, 2048, 4), (10000, 4, 2048, 4), (1 << 62, 8, 2048, 4)),
                 ((4096, 2, 4096, 8), (10000, 8, 2048, 8), (1 << 62, 16, 2048, 8))],
    "gemv_gated_fp8": [(8, 1024, 8), (4, 2048, 4), (16, 2048, 8), (8, 2048, 4), (4, 1024, 4)],
    "gemv_router_fp8": [(4, 1024, 8), (2, 2048, 4), (8, 2048, 8)],
    "block_n_lm_fp8": [16, 64],
    "block_k_lm_fp8": [1024, 256],
    "moe_fp8": [(2, 256, 1), (4, 512, 1), (2, 512, 2), (4, 512, 2), (1, 512, 1), (8, 512, 4)],
    "moe_down_fp8": [(2, 512, 1), (1, 256, 1), (2, 512, 2), (4, 512, 4)],
}


def build(key: str, max_len: int):
    from nexrt_vllm.engine import Engine
    from nexrt_vllm.engine.config import ModelConfig
    from nexrt_vllm.engine.model import Model
    from nexrt_vllm.engine.weights import random_weights
    cfg = ModelConfig.from_dict(D.SHAPES[key])
    tensors = D.fp8_weights(random_weights(cfg, torch.bfloat16, "cuda", seed=0), cfg)
    return Engine(cfg, Model(cfg, tensors, max_len), max_len)


def measure(eng, tuning, ctx: int) -> dict:
    from nexrt_vllm.engine.graph import FusedDecoder, GraphRunner
    fused = FusedDecoder(eng.model, eng.state, mode="fused", tuning=tuning)
    fused.state.position.fill_(ctx)
    groups = D.kernel_groups(fused)
    runner = GraphRunner(fused)
    runner.capture()
    g = runner._graph(False)
    fused.state.position.fill_(ctx)
    D.time_replays(g, 5)
    fused.state.position.fill_(ctx)
    step = sorted(D.time_replays(g, 100))[50]
    del runner, g, fused
    return {"step_us": step * 1e6, "groups": {k: v["us_per_step"] for k, v in groups.items()}}


def main(argv=None) -> int:
    from nexrt_vllm.engine.graph import Tuning
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="2b,35b")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    out = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "context": a.context,
           "default": dataclasses.asdict(Tuning()), "shapes": {}}
    for key in a.shapes.split(","):
        t0 = time.time()
        eng = build(key, a.context + 64)
        D.fill_context(eng, a.context, gen)
        eng.state.set_seq_len(a.context)
        res = {"default": measure(eng, Tuning(), a.context), "candidates": []}
        D.log(f"[{key}] built in {time.time() - t0:.0f}s; default step {res['default']['step_us']:.1f} us")
        for field, values in CANDIDATES.items():
            for v in values:
                try:
                    m = measure(eng, dataclasses.replace(Tuning(), **{field: v}), a.context)
                except Exception as e:  # noqa: BLE001 - a shape the kernels reject is a result too
                    m = {"error": f"{type(e).__name__}: {e}"}
                res["candidates"].append({"field": field, "value": v, **m})
                D.log(f"[{key}] {field}={v}: {m.get('step_us', m.get('error'))}")
        out["shapes"][key] = res
        del eng
        torch.cuda.empty_cache()
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    # per field: the value with the least step time summed over the shapes (default included)
    best = {}
    for field in CANDIDATES:
        totals = {"default": sum(r["default"]["step_us"] for r in out["shapes"].values())}
        for v in CANDIDATES[field]:
            ts = [c.get("step_us") for r in out["shapes"].values() for c in r["candidates"]
                  if c["field"] == field and c["value"] == v]
            if ts and None not in ts:
                totals[json.dumps(v)] = sum(ts)
        best[field] = min(totals, key=totals.get)
        D.log(f"best {field}: {best[field]} ({totals[best[field]]:.1f} us vs default {totals['default']:.1f})")
    out["best"] = best
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
