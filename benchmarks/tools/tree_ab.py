"""Time one benchmark command against two or more source trees, alternated, each run its own process.

A change to the GPU path is judged by the step or round time it gives against the code before it, on the
same machine in the same call: the runs alternate between the trees (A B A B ..., so drift and a warming
machine fall on both) and each run starts a fresh process (no allocator, compile-cache or L2 state carried
from the other tree's run). A tree is a directory holding `nexrt_vllm/` and `benchmarks/`: this checkout, or
an earlier revision exported with `git archive REV nexrt_vllm benchmarks | tar -x -C DIR` (a git-ignored
DIR travels to the GPU machine with the run's `carry`). Each run is `python3 SCRIPT ARGS --json FILE` with the
tree as working directory and PYTHONPATH; from the JSON (decode_bench's layout: `shapes` -> `contexts`) every
row's `step_ms` and `round_ms` are taken, labelled by shape, weight format and draft weights. The summary is
written after every run (a call cut short keeps what it measured): each run's numbers and, per tree and label,
the median and the ratio to the first tree's.

    git archive 1178a8b nexrt_vllm benchmarks | tar -x -C .work/old     # here, before the GPU call
    python3 benchmarks/tools/tree_ab.py --tree before=.work/old --tree after=. --reps 2 --out OUT/ab.json -- \\
        benchmarks/decode_bench.py --speculative mtp --shapes 2b --contexts 8192 --draft-vocab 32768 \\
        --no-eager-controls --draft-weights fp8 --steps 100 --parity-steps 0 --breakdown-ctx 1

Exits 1 when a run failed or gave no numbers (its log's tail is in the summary), 0 otherwise.
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

FIELDS = ("step_ms", "round_ms")


def rows(result: dict) -> dict[str, dict[str, float]]:
    """label -> {field: value} of a decode_bench-style result (`shapes` -> `contexts`)."""
    out = {}
    for s in result.get("shapes", []):
        tags = [str(s.get(k)) for k in ("shape", "dtype", "draft_weights") if s.get(k) is not None]
        for c in s.get("contexts", []):
            vals = {f: float(c[f]) for f in FIELDS if isinstance(c.get(f), (int, float))}
            if vals:
                out["/".join(tags + [f"ctx{c.get('context')}"])] = vals
    return out


def summarize(trees: list[str], runs: list[dict]) -> dict:
    """Per tree and label: the median of each field over the tree's runs, and its ratio to the first tree's."""
    med: dict[str, dict[str, dict[str, float]]] = {}
    for name in trees:
        by_label: dict[str, dict[str, list[float]]] = {}
        for r in runs:
            if r["tree"] == name:
                for label, vals in r.get("rows", {}).items():
                    for f, v in vals.items():
                        by_label.setdefault(label, {}).setdefault(f, []).append(v)
        med[name] = {lab: {f: statistics.median(v) for f, v in fs.items()} for lab, fs in by_label.items()}
    base = med.get(trees[0], {})
    ratio = {name: {lab: {f: v / base[lab][f] for f, v in fs.items() if base.get(lab, {}).get(f)}
                    for lab, fs in med[name].items()} for name in trees[1:]}
    return {"median": med, "ratio_to_" + trees[0]: ratio}


def run_one(root: str, script: str, args: list[str], out_json: str, timeout_s: float) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=root, PYTHONUNBUFFERED="1")
    try:
        p = subprocess.run([sys.executable, script, *args, "--json", out_json], cwd=root, env=env,
                           capture_output=True, text=True, timeout=timeout_s)
        return p.returncode, (p.stdout + p.stderr)[-2000:]
    except subprocess.TimeoutExpired as e:  # its output so far comes as bytes even with text=True
        text = "".join(b.decode(errors="replace") if isinstance(b, bytes) else (b or "") for b in (e.stdout, e.stderr))
        return 124, text[-2000:] + f"\n(timed out after {timeout_s:.0f} s)"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=DIR",
                    help="a source tree (at least two; the first is the baseline of the ratios)")
    ap.add_argument("--reps", type=int, default=2, help="runs per tree")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--out", required=True, help="the summary JSON")
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if not cmd:
        ap.error("the benchmark command follows `--`: SCRIPT [ARGS ...] (relative to each tree)")
    trees = []
    for t in a.tree:
        name, sep, path = t.partition("=")
        if not sep or not name or not path:
            ap.error(f"--tree wants NAME=DIR, got {t!r}")
        root = os.path.abspath(path)
        if not os.path.isfile(os.path.join(root, cmd[0])):
            ap.error(f"--tree {name}: {os.path.join(root, cmd[0])} does not exist")
        trees.append((name, root))
    if len(trees) < 2 or len({n for n, _ in trees}) != len(trees):
        ap.error("--tree: at least two, with distinct names")
    if a.reps < 1:
        ap.error("--reps must be at least 1")
    names = [n for n, _ in trees]
    report = {"command": " ".join(cmd), "trees": dict(trees), "reps": a.reps, "runs": []}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for name, root in trees:
                out_json = os.path.join(tmp, f"{name}_{rep}.json")
                t0 = time.time()
                rc, tail = run_one(root, cmd[0], cmd[1:], out_json, a.timeout)
                run = {"tree": name, "rep": rep, "rc": rc, "wall_s": round(time.time() - t0, 1)}
                try:
                    with open(out_json) as f:
                        run["rows"] = rows(json.load(f))
                except (OSError, ValueError):
                    run["rows"] = {}
                if rc != 0 or not run["rows"]:
                    ok, run["log_tail"] = False, tail
                report["runs"].append(run)
                report.update(summarize(names, report["runs"]))
                os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
                with open(a.out, "w") as f:
                    json.dump(report, f, indent=1)
                print(f"[tree_ab] {name} rep {rep}: rc {rc}, {run['wall_s']} s, {run['rows']}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
