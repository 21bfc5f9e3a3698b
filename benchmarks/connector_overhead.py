"""What loading NexRTConnector costs vLLM for requests the connector does not claim.

Runs the same batch-1 decode workload on three vLLM configurations, each in its own process,
in alternating rounds (the box is shared, so neighbours' load spreads over all three):

* ``plain``   - vLLM without any KV connector;
* ``null``    - vLLM with a connector whose every hook does nothing
                (``nexrt_vllm.bench.null_connector.NullConnector``):
                what vLLM itself charges for having *a* connector;
* ``nexrt``   - vLLM with NexRTConnector (mooncake transport), no request claimed.

Per request it reads vLLM's own timestamps (``RequestOutput.metrics``) and reports the median
TPOT. ``--profile CONFIG`` instead runs one configuration with engine core and worker in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) under cProfile and prints the top functions.

    python3 -m benchmarks.connector_overhead --rounds 3 --requests 8 --warmup 1 \
        --out benchmarks/results/connector_overhead.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

CONFIGS = ("plain", "null", "nexrt")


def kv_transfer_config(name: str) -> dict | None:
    if name == "plain":
        return None
    if name == "null":
        return {"kv_connector": "NullConnector", "kv_connector_module_path": "nexrt_vllm.bench.null_connector",
                "kv_role": "kv_both"}
    return {"kv_connector": "NexRTConnector", "kv_connector_module_path": "nexrt_vllm.connector",
            "kv_role": "kv_producer", "kv_connector_extra_config": {"transport": "mooncake"}}


def _child(args) -> None:
    import torch

    torch.set_num_threads(1)
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = dict(model=args.model, max_model_len=2048, kv_cache_memory_bytes=64 << 20,
                              disable_log_stats=False, enforce_eager=args.eager, seed=0)
    ktc = kv_transfer_config(args.child)
    if ktc is not None:
        kw["kv_transfer_config"] = ktc
    llm = LLM(**kw)
    vocab = llm.get_tokenizer().vocab_size
    sp = SamplingParams(max_tokens=args.osl, ignore_eos=True, temperature=0.0)

    def run(i: int) -> float:
        prompt = [(7 * i + 13 * k) % (vocab - 10) + 5 for k in range(args.isl)]
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        return (m.last_token_ts - m.first_token_ts) / (n - 1)

    for i in range(args.warmup):
        run(1000 + i)
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    tpots = [run(i) for i in range(args.requests)]
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
    print("RESULT " + json.dumps({"config": args.child, "tpot_s": tpots}), flush=True)


def _run_child(name: str, args, ckpt: str, profile: str | None = None) -> list[float]:
    cmd = [sys.executable, "-m", "benchmarks.connector_overhead", "--child", name, "--model", ckpt,
           "--requests", str(args.requests), "--warmup", str(args.warmup), "--isl", str(args.isl),
           "--osl", str(args.osl)] + (["--eager"] if args.eager else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if profile:
        cmd += ["--profile-out", profile]
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: cProfile sees it
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["tpot_s"]
    raise RuntimeError(f"{name} run failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: a fresh tiny Qwen3-Next)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds over the configs")
    ap.add_argument("--requests", type=int, default=8, help="measured requests per run (batch 1)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=96)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's default, compiled)")
    ap.add_argument("--out", help="write the summary JSON here")
    ap.add_argument("--profile", metavar="CONFIG", choices=CONFIGS,
                    help="instead: one in-process run of CONFIG under cProfile, top functions printed")
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", dest="profile_path", help=argparse.SUPPRESS)
    args, _ = ap.parse_known_args()
    if args.child:
        args.profile = args.profile_path
        return _child(args)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.model
        if ckpt is None:
            from nexrt_vllm.testing import make_checkpoint

            ckpt = make_checkpoint(os.path.join(tmp, "ckpt"), arch="qwen3_next")
        if args.profile:
            import pstats

            path = os.path.join(tmp, "prof")
            _run_child(args.profile, args, ckpt, profile=path)
            pstats.Stats(path).sort_stats("cumulative").print_stats(40)
            return
        runs: dict[str, list[float]] = {c: [] for c in args.configs}
        pooled: dict[str, list[float]] = {c: [] for c in args.configs}
        load: dict[str, list[float]] = {c: [] for c in args.configs}
        t0 = time.time()
        for r in range(args.rounds):
            order = args.configs if r % 2 == 0 else list(reversed(args.configs))
            for c in order:
                tp = _run_child(c, args, ckpt)
                runs[c].append(statistics.median(tp))
                pooled[c] += tp
                load[c].append(os.getloadavg()[0])
                print(f"round {r} {c}: median TPOT {1e3 * runs[c][-1]:.3f} ms, 1-min load {load[c][-1]:.2f}",
                      flush=True)
    med = {c: statistics.median(v) for c, v in runs.items()}
    summary = {
        "what": "median decode TPOT (ms) of unclaimed batch-1 requests; per-run medians, median over runs",
        "command": "python3 -m benchmarks.connector_overhead " + " ".join(sys.argv[1:]),
        "workload": {"isl": args.isl, "osl": args.osl, "requests_per_run": args.requests,
                     "warmup": args.warmup, "rounds": args.rounds, "enforce_eager": args.eager,
                     "model": "tiny Qwen3-Next (nexrt_vllm.testing.make_checkpoint)" if args.model is None
                     else args.model},
        "tpot_ms_runs": {c: [round(1e3 * x, 3) for x in v] for c, v in runs.items()},
        "tpot_ms_median": {c: round(1e3 * v, 3) for c, v in med.items()},
        "ratio_vs_plain": {c: round(v / med["plain"], 3) for c, v in med.items()} if "plain" in med else {},
        "tpot_ms_pooled_median": {c: round(1e3 * statistics.median(v), 3) for c, v in pooled.items()},
        # The box is shared: a request whose TPOT is > 2x the best run's median ran while other
        # jobs held a core (vLLM's engine core and worker spin-wait on each other every step).
        "slow_request_fraction": {c: round(sum(x > 2 * min(min(runs.values())) for x in v) / len(v), 3)
                                  for c, v in pooled.items()},
        "load_avg_1min_runs": {c: [round(x, 2) for x in v] for c, v in load.items()},
        "wall_s": round(time.time() - t0, 1),
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
