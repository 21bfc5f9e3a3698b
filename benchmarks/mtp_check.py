"""MTP speculative decoding, eager, on any device (the GPU graph round is not built): for the trained
tiny checkpoints with a trained MTP head (connector_harness.TRAINED_MTP, made here if absent),
greedy tokens with and without speculation (256 tokens, with the full MTP context and without),
acceptance per verify round, and the eager round / step times (labelled eager: not the product's
GPU path).

    PYTHONPATH=. python benchmarks/mtp_check.py --device cuda --out $OUT [--ckpt-dir DIR]

Writes $OUT/mtp_check.json; exit status 1 if any token differs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from nexrt_vllm.engine import Engine, SamplingParams  # noqa: E402
from nexrt_vllm.testing import make_checkpoint  # noqa: E402
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, periodic_prompt  # noqa: E402
from nexrt_vllm.testing.mtp_head import add_mtp_head  # noqa: E402


def checkpoint(root: str, arch: str) -> str:
    path = os.path.join(root, f"mtp_{arch}")
    if not os.path.exists(os.path.join(path, "config.json")):
        kw = {k: v for k, v in TRAINED_MTP[arch].items() if k != "mtp"}
        base = os.path.join(root, f"base_{arch}")
        if not os.path.exists(os.path.join(base, "config.json")):
            make_checkpoint(base, arch=arch, dtype="bfloat16", **kw)
        shutil.copytree(base, path)
        add_mtp_head(path, train=True)
    return path


def sync(dev):
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def run(path: str, dev: str, dtype: str) -> dict:
    plain = Engine.from_pretrained(path, device=dev, dtype=dtype, max_seq_len=1024, progress=False)
    spec = Engine.from_pretrained(path, device=dev, dtype=dtype, max_seq_len=1024, progress=False)
    spec.enable_speculative("mtp", 3)
    sp = SamplingParams(max_tokens=257, ignore_eos=True)
    out = {"prompts": []}
    for seed, n in ((1, 40), (2, 300)):
        prompt = periodic_prompt(n, seed=seed)
        first = int(plain.prefill(prompt).argmax())
        sync(dev)
        t = time.perf_counter()
        want = list(plain.stream(first, sp))
        sync(dev)
        step_s = (time.perf_counter() - t) / len(want)
        rec = {"prompt_len": n}
        for mode in ("full", "none"):
            spec.speculative.rounds = [0] * 5
            spec.prefill(prompt)
            if mode == "none":
                spec.import_state(*spec.export_state())
            sync(dev)
            t = time.perf_counter()
            got = list(spec.stream(first, sp))
            sync(dev)
            r = spec.speculative.rounds
            rounds = max(1, sum(r))
            rec[mode] = {"equal": got == want, "rounds": r,
                         "tokens_per_round": sum(k * c for k, c in enumerate(r)) / rounds,
                         "eager_round_s": (time.perf_counter() - t) / rounds}
        rec["eager_step_s"] = step_s
        out["prompts"].append(rec)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt-dir", default=None, help="where the trained checkpoints are (made if absent)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    root = args.ckpt_dir or os.path.join(args.out, "ckpts")
    res, ok = {}, True
    for arch in TRAINED_MTP:
        t = time.time()
        path = checkpoint(root, arch)
        res[arch] = run(path, args.device, args.dtype)
        res[arch]["seconds"] = time.time() - t
        ok &= all(p[m]["equal"] for p in res[arch]["prompts"] for m in ("full", "none"))
        print(arch, json.dumps(res[arch]), flush=True)
    res["all_equal"] = ok
    res["medians"] = {a: statistics.median(p["full"]["tokens_per_round"] for p in res[a]["prompts"])
                      for a in TRAINED_MTP}
    with open(os.path.join(args.out, "mtp_check.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
