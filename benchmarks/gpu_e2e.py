"""The whole product on one GPU, measured the InferenceX way.

NexRT path: client -> router -> vLLM (GPU prefill, NexRTConnector) -> hand-off -> NexRT decode node
(GPU, one CUDA graph per token) -> router -> client. Baseline: plain vLLM (no connector) on the same GPU
and model. Both are measured by `benchmarks/inferencex.py` (InferenceX's client rules), concurrency 1.

    python3 benchmarks/gpu_e2e.py --shape 2b --scenarios 1k1k 8k1k --num-prompts 16 \
        --tokenizer DIR --out OUT

Weights are random on both sides (vLLM's and the node's `--load-format dummy`; `ignore_eos` makes the
lengths fixed), so no real-shape checkpoint has to fit on disk. `--tokenizer` names a directory with the
real Qwen3.5 `tokenizer.json` (docs/BENCHMARKS.md says how to make it offline), so prompts and
detokenization cost what they do in production. `--layers N` cuts the shape to N layers (labelled in
the output) where two copies of the model do not fit beside each other.

`--concurrent-baseline` starts plain vLLM beside the NexRT stack (one vLLM after the other, each with a
fixed KV cache, all up together) and adds `ttft_breakdown`: per context, plain vLLM, the connector's vLLM
unclaimed (streamed, and as the router's one-token leg) and the router path, interleaved prompt by prompt,
with the router's own split of its TTFT (queue incl. admission, vLLM leg).

`--speculative mtp` measures the speculative tier the InferenceX way: the node serves MTP rounds
(`--num-speculative-tokens K`) and the baseline is vLLM serving MTP with the same draft count, both at
the same pinned acceptance length (`--acceptance-length`, default InferenceX's golden value for K:
3.39 at 3 drafts), interleaved with plain vLLM for reference (`--concurrent-baseline --interleave`).
The summary's ratios are then against vLLM + MTP (`ratios_vs_plain_vllm` keeps the others).

`--conc 1 2 4 8` sweeps the client's concurrency (each path measured at each, one path after the other;
with `--concurrent-baseline` every vLLM stays up, and each path is measured while the others idle —
one start-up instead of one per path;
`--max-batch B` gives the node B slots, `--vllm-mtp` adds vLLM + MTP at the golden acceptance as a
baseline while the node decodes plainly): `concurrency` holds every result, `pareto` the points
(median tok/s/user, output tok/s per GPU: the prefill vLLM and the node share the one GPU, so a path
counts 1 GPU) and `ratios_by_conc` NexRT against the best baseline at each concurrency;
OUT/gpu_e2e_<label>_pareto.png draws them.

`--tp N` runs the node tensor-parallel (`nexrt-decode --tp N`: rank r on cuda:r, each on the graph path)
and both vLLMs with `--tensor-parallel-size N` on the same GPUs; the engine step comes from
`decode_bench --tp N`.

`gpu_e2e.py merge A.json B.json --json OUT.json --png OUT.png [--engine DECODE.json]` joins runs (of a
shape that measured different `--paths`; several shapes become sections) into one summary with the
ratios, and draws one overlay of them all; runs of a sweep (`--conc`) join their concurrencies, and the
merged sweep gets its `pareto`, `ratios_by_conc` and chart (OUT_pareto.png) afresh.

Writes OUT/gpu_e2e_<label>.json (summary: TPOT / TTFT / interactivity / E2EL medians of both paths,
ratios, the node's step-time and hand-off metrics per scenario, the engine's own step time from
decode_bench at the same contexts) and OUT/gpu_e2e_<label>_raw.tar.gz (InferenceX raw + agg files).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request

from nexrt_vllm.bench.model_dir import ARCH, write_model_dir
from nexrt_vllm.bench.shapes import NAMES, SHAPES
from nexrt_vllm.launch import Procs, free_port, vllm_argv, wait_file, wait_http

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # children run from here: `-m benchmarks.X`

SCENARIOS = {"1k1k": (1024, 1024), "8k1k": (8192, 1024)}
# InferenceX's golden acceptance lengths for Qwen3.5 MTP (SPEED-Bench coding), by draft count
GOLDEN_AL = {1: 1.93, 2: 2.73, 3: 3.39, 4: 3.97}


def scenario(s: str) -> tuple[int, int]:
    """1k1k | 8k1k | <isl>x<osl>"""
    if s in SCENARIOS:
        return SCENARIOS[s]
    m = re.fullmatch(r"(\d+)x(\d+)", s)
    if not m:
        raise argparse.ArgumentTypeError(f"scenario {s!r}: 1k1k, 8k1k or ISLxOSL")
    return int(m[1]), int(m[2])
def log(*a):
    print(f"[gpu_e2e {time.strftime('%H:%M:%S')}]", *a, flush=True)


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {metric{labels}: value} (sums and counts of the node's histograms)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out


def node_delta(before: dict, after: dict) -> dict:
    def d(k):
        return after.get(k, 0.0) - before.get(k, 0.0)

    steps = d("nexrt_decode_step_seconds_count")
    xfers = d("nexrt_transfer_seconds_count")
    rounds = d("nexrt_spec_acceptance_length_count")
    return {"steps": steps, "step_ms_mean": 1e3 * d("nexrt_decode_step_seconds_sum") / steps if steps else None,
            "spec_rounds": rounds,
            "acceptance_length": d("nexrt_spec_acceptance_length_sum") / rounds if rounds else None,
            "handoffs": xfers,
            "handoff_ms_mean": 1e3 * d("nexrt_transfer_seconds_sum") / xfers if xfers else None,
            "handoff_bytes_mean": d("nexrt_transfer_bytes_total") / xfers if xfers else None,
            "convert_ms_mean": (1e3 * d("nexrt_convert_seconds_sum") / d("nexrt_convert_seconds_count")
                                if d("nexrt_convert_seconds_count") else None)}


def inferencex(base_url: str, label: str, model: str, tok_dir: str, sc: str, n: int, result_dir: str,
               headers: list[str], kv: str, hw: str, interleave: dict[str, str] | None = None,
               conc: int = 1) -> dict[str, dict]:
    """One scenario through benchmarks/inferencex.py at concurrency `conc` (n prompts, at least 2 per
    client); `interleave`: {label: URL} of baselines measured request by request with this path (conc 1).
    Returns {label: summary}."""
    isl, osl = scenario(sc)
    n = max(n, 2 * conc)
    cmd = [sys.executable, "-m", "benchmarks.inferencex", "run", "--base-url", base_url, "--model", model,
           "--tokenizer", tok_dir, "--isl", str(isl), "--osl", str(osl), "--conc", str(conc), "--num-prompts", str(n),
           "--result-dir", result_dir, "--label", label, "--hw", hw, "--disable-tqdm", "--save-detailed",
           "--ready-timeout", "60", "--prefill-gpus", "1", "--decode-gpus", "1", "--kv-p2p-transfer", kv]
    if headers:
        cmd += ["--header", *headers]
    if interleave:
        cmd += ["--interleave", *(f"{k}={u}" for k, u in interleave.items()), "--interleave-kv-p2p-transfer", ""]
    log("run", " ".join(cmd[2:]))
    err = _run(cmd, ROOT, 1800, 3000)
    if err:
        raise RuntimeError(f"inferencex {label} {sc}: {err}")
    keep = ("completed", "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
            "mean_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "output_throughput")
    res = {}
    for name in [label] + list(interleave or ()):
        with open(os.path.join(result_dir, name, f"{name}_isl{isl}_osl{osl}_conc{conc}.json")) as f:
            raw = json.load(f)
        out = {k: raw.get(k) for k in keep}
        out["median_interactivity_tok_s"] = 1e3 / raw["median_tpot_ms"] if raw.get("median_tpot_ms") else None
        out["conc"] = conc
        res[name] = out
    return res


def _run(cmd: list[str], cwd: str, timeout: float, tail: int = 2000) -> str | None:
    """Run a child benchmark, echo the end of its output; None if it succeeded, else its error."""
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    sys.stdout.write(p.stdout[-tail:])
    if p.returncode == 0:
        return None
    sys.stdout.write(p.stderr[-3000:])
    name = cmd[2] if cmd[1] == "-m" else os.path.basename(cmd[1])
    return f"{name} exited {p.returncode}: {p.stderr[-500:]}"


def ix_client(client_dir: str, base_url: str, model_dir: str, sc: str, n: int, out_dir: str, label: str) -> dict:
    """InferenceX's own client (utils/bench_serving/benchmark_serving.py, unchanged) with the flags of its
    benchmark_lib.sh, as a cross-check of benchmarks/inferencex.py."""
    isl, osl = scenario(sc)
    name = f"ix_{label}_isl{isl}_osl{osl}_conc1"
    cmd = [sys.executable, os.path.join(client_dir, "benchmark_serving.py"), "--model", model_dir,
           "--served-model-name", "model", "--backend", "vllm", "--base-url", base_url, "--dataset-name", "random",
           "--random-input-len", str(isl), "--random-output-len", str(osl), "--random-range-ratio", "0.8",
           "--num-prompts", str(n), "--max-concurrency", "1", "--request-rate", "inf", "--ignore-eos",
           "--save-result", "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--result-dir", out_dir, "--result-filename", name + ".json"]
    os.makedirs(out_dir, exist_ok=True)
    log("run InferenceX client", " ".join(cmd[2:]))
    err = _run(cmd, client_dir, 1800)
    if err:
        return {"error": err}
    with open(os.path.join(out_dir, name + ".json")) as f:
        raw = json.load(f)
    return {k: raw.get(k) for k in ("completed", "median_ttft_ms", "median_tpot_ms", "median_e2el_ms",
                                    "p99_tpot_ms", "output_throughput")}


def engine_step(shape: str, contexts: list[int], layers: int | None, out_json: str, spec_tokens: int = 0,
                tp: int = 1, draft: list[str] | None = None) -> dict:
    """decode_bench at the scenario contexts (the engine alone, same GPUs, nothing else running); with
    `spec_tokens`, the captured MTP round against the plain step; at TP = `tp`."""
    cmd = [sys.executable, "-m", "benchmarks.decode_bench", "--shapes", shape, "--contexts",
           ",".join(map(str, contexts)), "--steps", "200", "--parity-steps", "0", "--eager-steps", "2",
           "--json", out_json, "--tp", str(tp)] + (["--layers", str(layers)] if layers else [])
    if spec_tokens:
        cmd += ["--speculative", "mtp", "--num-speculative-tokens", str(spec_tokens)]
        cmd += draft or []
    log("run", " ".join(cmd[2:]))
    err = _run(cmd, ROOT, 900, 1500)
    if err:
        return {"error": err}
    with open(out_json) as f:
        return _engine_rows(json.load(f))


def _ratios(n: dict | None, v: dict | None) -> dict | None:
    if not (n and v and n.get("median_tpot_ms") and v.get("median_tpot_ms")):
        return None
    return {"interactivity_x": v["median_tpot_ms"] / n["median_tpot_ms"],
            "ttft_delta_ms": n["median_ttft_ms"] - v["median_ttft_ms"],
            "e2el_x": v["median_e2el_ms"] / n["median_e2el_ms"]}


def add_ratios(summary: dict, scenarios) -> None:
    """NexRT vs the baseline's medians (vLLM + MTP when measured, else plain vLLM), and NexRT's TPOT over
    the engine's own step (or, speculating, over round / acceptance length) at the scenario's ISL."""
    spec = bool(summary.get("vllm_mtp"))
    for sc in scenarios:
        n = summary["nexrt"].get(sc)
        r = _ratios(n, (summary["vllm_mtp"] if spec else summary["vllm"]).get(sc))
        if r is None:
            continue
        eng = (summary.get("engine") or {}).get("contexts", {})
        ctx = scenario(sc)[0]
        step = eng.get(ctx) or eng.get(str(ctx))
        if step and not spec:
            r["tpot_over_engine_step"] = n["median_tpot_ms"] / step["step_ms_median"]
        al = summary.get("acceptance_length")
        if step and spec and step.get("round_ms") and al:
            r["engine_round_ms"] = step["round_ms"]
            r["tpot_over_round_per_acceptance"] = n["median_tpot_ms"] / (step["round_ms"] / al)
        summary.setdefault("ratios", {})[sc] = r
        if spec and (plain := _ratios(n, summary["vllm"].get(sc))):
            summary.setdefault("ratios_vs_plain_vllm", {})[sc] = plain


def add_sweep(summary: dict, scenarios, png: str | None) -> None:
    """`pareto` points and `ratios_by_conc` (NexRT against the best baseline at each concurrency: the higher
    median interactivity) from `concurrency`; the Pareto chart per scenario into `png`."""
    runs = summary.get("concurrency") or {}
    gpus = summary.get("gpus", 1)
    for path, by_sc in runs.items():
        for sc, by_c in by_sc.items():
            summary.setdefault("pareto", {}).setdefault(sc, {})[path] = [
                {"conc": int(c), "tok_s_user": r["median_interactivity_tok_s"],
                 "output_tok_s_gpu": r["output_throughput"] / gpus} for c, r in sorted(by_c.items(), key=lambda x: int(x[0]))
                if r.get("median_interactivity_tok_s")]
    for sc in scenarios:
        mine = (runs.get("nexrt") or {}).get(sc) or {}
        for c, n in mine.items():
            base = [(name, by_sc[sc][c]) for name, by_sc in runs.items()
                    if name != "nexrt" and c in by_sc.get(sc, {}) and by_sc[sc][c].get("median_tpot_ms")]
            if not base or not n.get("median_tpot_ms"):
                continue
            name, best = max(base, key=lambda b: b[1]["median_interactivity_tok_s"])
            r = _ratios(n, best) | {"baseline": name,
                                    "output_throughput_x": n["output_throughput"] / best["output_throughput"]}
            summary.setdefault("ratios_by_conc", {}).setdefault(sc, {})[c] = r
        one = mine.get("1") or mine.get(1)
        if one and len(mine) > 1:
            top = max(mine.items(), key=lambda x: int(x[0]))
            summary.setdefault("nexrt_throughput_scaling", {})[sc] = {
                "conc": int(top[0]), "output_tok_s_over_conc1": top[1]["output_throughput"] / one["output_throughput"]}
    if png and summary.get("pareto"):
        from nexrt_vllm.bench.pareto import plot_pareto
        mb = summary.get("max_batch") or 1
        names = {"nexrt": "NexRT path" + (" + MTP" if summary.get("speculative") == "mtp" else "")
                 + (f" (--max-batch {mb})" if mb > 1 else ""), "vllm": "vLLM",
                 "vllm_mtp": f"vLLM + MTP (acceptance {summary.get('acceptance_length')})"}
        for sc, series in summary["pareto"].items():
            pts = {names.get(path, path): [{"conc": p["conc"], "median_intvty": p["tok_s_user"],
                                            "output_tput_per_gpu": p["output_tok_s_gpu"]} for p in rows]
                   for path, rows in series.items() if rows}
            if pts:
                plot_pareto(pts, png.replace(".png", f"_{sc}.png") if len(summary["pareto"]) > 1 else png,
                            title=f"{summary.get('shape')} {sc}, one {summary.get('hw', 'GPU')}",
                            y_key="output_tput_per_gpu")


def _engine_rows(res: dict) -> dict:
    rows = res["shapes"][0]["contexts"] if res.get("shapes") else []

    def row(r):
        if "round_ms" in r:  # decode_bench --speculative mtp
            return {"step_ms_median": r["step_ms"], "round_ms": r["round_ms"], "round_over_step": r["round_over_step"]}
        return {"step_ms_median": r["step_ms_median"], "mbu": r["mbu"]}
    return {"copy_bw_Bps": res.get("copy_bw_Bps"), "contexts": {r["context"]: row(r) for r in rows}}


def _label(run: dict) -> str:
    full = {NAMES[k]: v["num_hidden_layers"] for k, v in SHAPES.items()}.get(run["shape"])
    return (run["shape"] + (f" ({run['layers']} of {full} layers)" if full and run.get("layers") != full else "")
            + (", interleaved" if run.get("interleaved") else ""))


def _merge_shape(paths: list[str], runs: list[dict]) -> dict:
    m = {**runs[0], "command": [r["command"] for r in runs], "merged_from": [os.path.basename(p) for p in paths]}
    # what the node served with, from the last run that measured the NexRT path, whatever the files' order (a
    # baselines-only run records the flags it would have given a node)
    served = [r for r in runs if r.get("nexrt") or (r.get("concurrency") or {}).get("nexrt")]
    if served:
        for key in ("node_speculative_flags", "draft_weights", "node_tuning"):
            if key in served[-1]:
                m[key] = served[-1][key]
            else:
                m.pop(key, None)
    for key in ("nexrt", "vllm", "vllm_mtp", "node", "ttft_breakdown"):
        m[key] = {k: v for r in runs for k, v in r.get(key, {}).items()}
    for key in ("engine", "inferencex_client"):
        vals = [r[key] for r in runs if r.get(key) and "skipped" not in r[key]]
        m[key] = vals[-1] if key == "engine" and vals else {k: v for d in vals for k, v in d.items()}
    # sweeps: path -> scenario -> concurrency -> result, joined across runs (each run measured some)
    sweep: dict = {}
    for r in runs:
        for path, by_sc in (r.get("concurrency") or {}).items():
            for sc, by_c in by_sc.items():
                sweep.setdefault(path, {}).setdefault(sc, {}).update(by_c)
    if sweep:
        m["concurrency"] = sweep
        m["conc"] = sorted({int(c) for by_sc in sweep.values() for by_c in by_sc.values() for c in by_c})
        m["max_batch"] = max(r.get("max_batch") or 1 for r in runs)
    for key in ("error", "ratios", "ratios_vs_plain_vllm", "pareto", "ratios_by_conc", "nexrt_throughput_scaling"):
        m.pop(key, None)
    return m


def merge(paths: list[str], out: str, png: str | None, engine: list[str] = ()) -> int:
    """One summary from runs on one GPU: runs of a shape that measured different --paths are joined;
    several shapes become sections of "shapes". `engine`: decode_bench JSONs (e.g. of a --layers cut)
    that give the engine's own step to the shape they ran."""
    groups: dict[str, tuple[list, list]] = {}
    for p in paths:
        r = json.load(open(p))
        g = groups.setdefault(_label(r), ([], []))
        g[0].append(p)
        g[1].append(r)
    shapes = {label: _merge_shape(*g) for label, g in groups.items()}
    for e in engine:
        res = json.load(open(e))
        cfg = res["shapes"][0]["config"]
        for label, m in shapes.items():
            if not m.get("engine") and res["shapes"][0]["shape"].startswith(m["shape"]) \
                    and cfg["num_hidden_layers"] == m["layers"]:
                m["engine"] = {**_engine_rows(res), "command": res.get("command")}
    for label, m in shapes.items():
        add_ratios(m, sorted(set(m["nexrt"]) | set(m["vllm"]) | set(m.get("vllm_mtp") or ())))
        if m.get("concurrency"):
            scs = sorted({sc for by_sc in m["concurrency"].values() for sc in by_sc})
            pareto = png and png.replace(".png", "_pareto.png" if len(shapes) == 1 else
                                         f"_{re.sub(r'[^A-Za-z0-9.]+', '_', label).strip('_')}_pareto.png")
            add_sweep(m, scs, pareto or None)
    first = next(iter(shapes.values()))
    result = first if len(shapes) == 1 else {"hw": first.get("hw"), "shapes": shapes}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    if png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, (label, m) in enumerate(shapes.items()):
            names = {"nexrt": "NexRT" + (" + MTP" if m.get("vllm_mtp") else ""), "vllm": "vLLM only",
                     "vllm_mtp": "vLLM + MTP"}
            for j, (path, mark) in enumerate((("nexrt", "o"), ("vllm", "s"), ("vllm_mtp", "^"))):
                pts = [(1e3 / r["median_tpot_ms"], r["output_throughput"], sc) for sc, r in sorted(m.get(path, {}).items())
                       if r.get("median_tpot_ms")]
                if not pts:
                    continue
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=mark, s=50, color=f"C{3 * i + j}",
                           label=f"{label}: {names[path]}")
                for x, y, sc in pts:
                    ax.annotate(sc, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.set_xlabel("interactivity (tok/s/user, 1000 / median TPOT)")
        ax.set_ylabel("output throughput per GPU (tok/s)")
        ax.set_title(f"NexRT path vs vLLM only on one {first.get('hw', '?')}, conc 1 (InferenceX rules)")
        ax.grid(alpha=0.3)
        if ax.collections:
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
    log("merged", json.dumps({label: m.get("ratios") for label, m in shapes.items()}))
    return 0


class Stack:
    def __init__(self, workdir: str, device: str, tp: int = 1):
        self.procs = Procs(workdir)
        self.workdir, self.device, self.tp = workdir, device, tp

    async def node(self, model: str, max_len: int, transport: str, recv_memory: str, extra=()) -> str:
        ready = os.path.join(self.workdir, "node.ready")
        self.procs.start("node", [sys.executable, "-m", "nexrt_vllm.node.server", "--model", model,
                                  "--device", self.device, "--load-format", "dummy", "--port", "0",
                                  "--transport", transport, "--recv-memory", recv_memory,
                                  "--max-seq-len", str(max_len), "--ready-file", ready,
                                  "--transfer-timeout", "60", "--start-timeout", "60", "--tp", str(self.tp),
                                  *extra])
        return ready

    def vllm(self, name: str, model: str, max_len: int, transport: str | None, share: float,
             kv_bytes: int | None = None, speculative: dict | None = None) -> str:
        port = free_port()
        extra = ["--load-format", "dummy", "--served-model-name", "model", "--tensor-parallel-size", str(self.tp)]
        if speculative:
            extra += ["--speculative-config", json.dumps(speculative)]
        if kv_bytes:  # a fixed KV cache: vLLM skips the memory profiling a neighbour starting beside it would falsify
            extra += ["--kv-cache-memory-bytes", str(kv_bytes)]
        self.procs.start(name, vllm_argv(model, port, max_len, transport, self.device, share, extra=extra))
        return f"http://127.0.0.1:{port}"

    def router(self, vllm_url: str, node_url: str, tokenizer: str, queue: int = 4) -> str:
        port = free_port()
        self.procs.start("router", [sys.executable, "-m", "nexrt_vllm.router.server", "--port", str(port),
                                    "--vllm-url", vllm_url, "--decode-url", node_url, "--tokenizer", tokenizer,
                                    "--default-class", "interactive",
                                    # measure the fast path: a failed hand-off must show, not degrade
                                    "--fallback", "error",
                                    "--queue-size", str(queue), "--queue-timeout", "120", "--log-level", "WARNING"])
        return f"http://127.0.0.1:{port}"


async def _first_chunk(session, url: str, body: dict) -> tuple[float, dict | None]:
    """(seconds to the first chunk with choices, the router's nexrt_timing if the stream has one)."""
    import aiohttp

    t0 = time.perf_counter()
    ttft, timing = None, None
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}: {(await r.text())[:300]}")
        if not body.get("stream"):
            data = await r.json()
            return time.perf_counter() - t0, data.get("nexrt_timing")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            timing = d.get("nexrt_timing", timing)
    return ttft, timing


async def ttft_breakdown(urls: dict[str, str], tok_dir: str, isl: int, osl: int, n: int) -> dict:
    """Where the NexRT path's TTFT goes, against plain vLLM, prompt by prompt (the paths interleaved,
    each path its own prompts of exactly `isl` tokens so no prefix cache serves another path):
    - vllm_plain: plain vLLM streamed (the baseline's TTFT);
    - vllm_connector: the vLLM with the connector, unclaimed, streamed (what loading the connector costs);
    - vllm_connector_leg: the same, non-streaming, 1 token, token ids back (the router's vLLM leg, unclaimed);
    - nexrt: through the router (claimed); its nexrt_timing splits queue (incl. admission) and the vLLM leg.
    `after_decode` repeats it as the benchmark runs (each request decodes `osl` tokens) with the
    unclaimed leg sent right after each router request: what a long decode before a request changes."""
    import aiohttp
    import statistics

    from nexrt_vllm.bench.inferencex import PromptTokenizer, sample_random_requests

    tok = PromptTokenizer(tok_dir)
    paths = {"vllm_plain": (urls["vllm_plain"], True), "vllm_connector": (urls["vllm_connector"], True),
             "vllm_connector_leg": (urls["vllm_connector"], False), "nexrt": (urls["nexrt"], True)}
    prompts = {p: sample_random_requests(tok, isl, 2, n, range_ratio=1.0, seed=100 + k)
               for k, p in enumerate(paths)}
    long_paths = {"nexrt": (urls["nexrt"], True), "vllm_connector_leg": (urls["vllm_connector"], False),
                  "vllm_plain": (urls["vllm_plain"], True)}
    seeds = {p: 200 + k for k, p in enumerate(paths)}  # fresh prompts: no prefix-cache hit from the first phase
    fresh = {p: sample_random_requests(tok, isl, 2, n, range_ratio=1.0, seed=seeds[p]) for p in long_paths}

    async def rounds(s, paths: dict, prompts: dict, max_tokens: int) -> dict[str, list]:
        rows: dict[str, list] = {p: [] for p in paths}
        for i in range(n):
            for p, (url, stream) in paths.items():
                body = {"model": "model", "prompt": prompts[p][i].prompt, "temperature": 0.0, "ignore_eos": True}
                body.update({"max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
                            if stream else {"max_tokens": 1, "stream": False, "return_token_ids": True})
                ttft, timing = await _first_chunk(s, url + "/v1/completions", body)
                row = {"ttft_ms": 1e3 * ttft}
                if timing:
                    row.update({k[:-2] + "_ms": 1e3 * timing[k] for k in ("queue_s", "prefill_s") if k in timing})
                rows[p].append(row)
        return rows

    async with aiohttp.ClientSession() as s:
        rows = await rounds(s, paths, prompts, 2)
        long_rows = await rounds(s, long_paths, fresh, osl)

    def medians(rows):
        med = {p: statistics.median(r["ttft_ms"] for r in v) for p, v in rows.items()}
        for k in ("queue_ms", "prefill_ms"):
            vals = [r[k] for r in rows["nexrt"] if k in r]
            if vals:
                med["nexrt_" + k] = statistics.median(vals)
        return med

    return {"isl": isl, "prompts_per_path": n, "median_ms": medians(rows), "rows": rows,
            "after_decode": {"osl": osl, "median_ms": medians(long_rows), "rows": long_rows}}


async def _up(stack: Stack, urls: list[tuple[str, str]], timeout: float) -> None:
    for url, what in urls:
        await wait_http(f"{url}/health", stack.procs, timeout, what)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "merge":
        mp = argparse.ArgumentParser(prog="gpu_e2e.py merge", description=merge.__doc__)
        mp.add_argument("runs", nargs="+")
        mp.add_argument("--json", required=True)
        mp.add_argument("--png", default=None)
        mp.add_argument("--engine", nargs="*", default=[], help="decode_bench JSONs of shapes whose runs lack the engine step")
        ma = mp.parse_args(argv[1:])
        return merge(ma.runs, ma.json, ma.png, ma.engine)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(ARCH), default="2b")
    ap.add_argument("--layers", type=int, default=None, help="cut the shape to N layers (labelled)")
    ap.add_argument("--scenarios", nargs="+", default=["1k1k", "8k1k"], help="1k1k | 8k1k | ISLxOSL")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the same script on vLLM-CPU (with --shape tiny), to check it before a GPU run")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--tokenizer", required=True, help="dir with the Qwen3.5 tokenizer.json")
    ap.add_argument("--transport", choices=("nixl", "mooncake"), default="nixl")
    ap.add_argument("--recv-memory", choices=("device", "pinned"), default="device")
    ap.add_argument("--share", type=float, default=None,
                    help="vLLM's --gpu-memory-utilization (default: 0.25 for 2b; 0.5 otherwise)")
    ap.add_argument("--baseline-share", type=float, default=None,
                    help="--gpu-memory-utilization of a baseline vLLM that runs alone on the GPU (plain, + MTP; "
                         "default: --share). A sweep's baseline needs KV room for its concurrency: 0.25 of an "
                         "80 GB GPU held four 9K-token requests")
    ap.add_argument("--concurrent-baseline", action="store_true",
                    help="start plain vLLM beside the NexRT stack, both vLLMs at once (needs memory for 3 models); "
                         "also measures the TTFT breakdown")
    ap.add_argument("--interleave", action="store_true",
                    help="with --concurrent-baseline: the two paths request by request in one run (the same prompts, "
                         "order rotated per prompt) instead of one after the other")
    ap.add_argument("--kv-cache-gib", type=int, default=4, help="each vLLM's fixed KV cache with --concurrent-baseline")
    ap.add_argument("--breakdown-prompts", type=int, default=8,
                    help="prompts per path and context in the TTFT breakdown (--concurrent-baseline)")
    ap.add_argument("--skip-engine-bench", action="store_true")
    ap.add_argument("--ix-client", default=None,
                    help="dir with InferenceX's utils/bench_serving/*.py: also run its own client (cross-check)")
    ap.add_argument("--ix-scenarios", nargs="*", default=None, help="scenarios for --ix-client (default: all)")
    ap.add_argument("--ix-num-prompts", type=int, default=None, help="prompts per --ix-client run (default --num-prompts)")
    ap.add_argument("--paths", nargs="+", choices=("nexrt", "vllm", "vllm_mtp"), default=None,
                    help="which paths to measure: the NexRT path, plain vLLM, vLLM + MTP (default: all three with "
                         "--speculative mtp or --vllm-mtp, else the first two); a run cut short can be completed "
                         "by another with the rest, joined by `merge`")
    ap.add_argument("--speculative", choices=("off", "mtp"), default="off",
                    help="mtp: the node serves MTP rounds and the baseline is vLLM + MTP, both at the pinned "
                         "--acceptance-length (plain vLLM interleaved for reference)")
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="the node's --draft-vocab N: its MTP head drafts from the first N token ids (default: all)")
    ap.add_argument("--draft-token-map", default=None, metavar="FILE",
                    help="the node's --draft-token-map FILE: its MTP head drafts from the map's ids")
    ap.add_argument("--draft-weights", default="checkpoint", metavar="FORMAT",
                    help="the node's --draft-weights (checkpoint: the MTP head as stored; fp8: its projections and "
                         "lm_head rows quantized at load for its single-row drafts), decode_bench's in the same run; "
                         "recorded in the JSON. Pinned acceptance hides what fp8 drafting does to acceptance")
    ap.add_argument("--acceptance-length", type=float, default=None,
                    help="pinned mean tokens per round for both (default: InferenceX's golden value for the "
                         "draft count, e.g. 3.39 at 3)")
    ap.add_argument("--conc", type=int, nargs="+", default=[1],
                    help="client concurrencies to sweep (each path at each; > 1: one path after the other)")
    ap.add_argument("--max-batch", type=int, default=1, help="the node's --max-batch (requests decoded together)")
    ap.add_argument("--node-tuning", default="", metavar="FIELD=VALUE,...",
                    help="the node's --tuning (launch-shape overrides of the fused kernels); recorded in the JSON")
    ap.add_argument("--vllm-mtp", action="store_true",
                    help="measure vLLM + MTP (golden acceptance) as a baseline while the node decodes plainly")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel node (and vLLMs) over N GPUs")
    ap.add_argument("--out", required=True)
    ap.add_argument("--start-timeout", type=float, default=420)
    a = ap.parse_args(argv)
    spec = a.speculative == "mtp"
    if any(c < 1 for c in a.conc) or len(set(a.conc)) != len(a.conc):
        ap.error("--conc: distinct concurrencies >= 1")
    sweep = a.conc != [1]
    if sweep and a.interleave:
        ap.error("--interleave runs at concurrency 1 (a sweep measures one path after the other)")
    if a.vllm_mtp and spec:
        ap.error("--vllm-mtp is for a plain node; --speculative mtp already measures vLLM + MTP")
    if spec or a.vllm_mtp:
        if a.acceptance_length is None:
            if a.num_speculative_tokens not in GOLDEN_AL:
                ap.error(f"no golden acceptance length for {a.num_speculative_tokens} drafts: give --acceptance-length")
            a.acceptance_length = GOLDEN_AL[a.num_speculative_tokens]
    default_paths = ["nexrt", "vllm"] + (["vllm_mtp"] if spec or a.vllm_mtp else [])
    a.paths = a.paths or default_paths
    if "vllm_mtp" in a.paths and not (spec or a.vllm_mtp):
        ap.error("--paths vllm_mtp: the MTP baseline needs --speculative mtp or --vllm-mtp (its config)")
    if a.draft_vocab is not None and a.draft_token_map:
        ap.error("give --draft-vocab or --draft-token-map, not both")
    if (a.draft_vocab is not None or a.draft_token_map) and not spec:
        ap.error("--draft-vocab / --draft-token-map are for --speculative mtp")
    if a.draft_weights != "checkpoint":
        if not spec:
            ap.error("--draft-weights is for --speculative mtp")
        from nexrt_vllm.engine.spec.mtp import DRAFT_WEIGHTS  # torch: only for a format to check
        if a.draft_weights not in DRAFT_WEIGHTS:
            ap.error(f"--draft-weights: one of {', '.join(DRAFT_WEIGHTS)}, got {a.draft_weights!r}")
    # the head's draft vocabulary and weights, as the node and decode_bench take them
    draft = ["--draft-vocab", str(a.draft_vocab)] if a.draft_vocab is not None else \
        ["--draft-token-map", os.path.abspath(a.draft_token_map)] if a.draft_token_map else []
    draft += ["--draft-weights", a.draft_weights] if a.draft_weights != "checkpoint" else []
    if a.tp < 1:
        ap.error("--tp must be >= 1")
    for flag, v in (("--share", a.share), ("--baseline-share", a.baseline_share)):
        if v is not None and not 0 < v <= 1:
            ap.error(f"{flag}: a fraction of the GPU's memory in (0, 1], got {v}")
    if a.tp > 1 and spec:
        ap.error("--tp > 1 with --speculative mtp: the node does not run MTP at TP > 1")
    if a.interleave and not (a.concurrent_baseline and {"nexrt", "vllm"} <= set(a.paths)):
        ap.error("--interleave needs --concurrent-baseline and the paths nexrt and vllm")
    for sc in a.scenarios:
        scenario(sc)
    if a.ix_client:
        a.ix_client = os.path.abspath(a.ix_client)
    if a.device == "cpu" and a.recv_memory == "device":
        a.recv_memory = "host"

    os.makedirs(a.out, exist_ok=True)
    label = a.shape + (f"_l{a.layers}" if a.layers else "") + (f"_tp{a.tp}" if a.tp > 1 else "") \
        + ("" if sorted(a.paths) == sorted(default_paths) else "_" + "-".join(a.paths)) \
        + (f"_conc{'-'.join(map(str, a.conc))}" if sweep else "")
    work = tempfile.mkdtemp(prefix="gpu-e2e-")
    name = NAMES.get(a.shape, "tiny-qwen3-next")
    model = os.path.join(work, name + (f"-{a.layers}L" if a.layers else ""))
    info = write_model_dir(model, a.shape, a.tokenizer, a.layers, mtp=spec or a.vllm_mtp)
    share = a.share or (0.25 if a.shape == "2b" else 0.5)
    alone_share = a.baseline_share or share  # a baseline vLLM with the GPU to itself
    max_len = max(i + o for i, o in map(scenario, a.scenarios)) + 512
    res_dir = os.path.join(work, "results")
    summary = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "interleaved": a.interleave,
               "shape": name, "device": a.device, "layers": info["layers"], "weights": "random (dummy load, both sides)",
               "transport": a.transport, "recv_memory": a.recv_memory, "vllm_gpu_memory_utilization": share,
               "baseline_gpu_memory_utilization": alone_share,
               "num_prompts": a.num_prompts, "conc": 1, "tp": a.tp, "nexrt": {}, "vllm": {}, "node": {}}
    if sweep:
        summary.update({"conc": a.conc, "concurrency": {}, "gpus": a.tp, "max_batch": a.max_batch})
    node_extra, vspec = ["--max-batch", str(a.max_batch)] if a.max_batch > 1 else [], None
    if a.node_tuning:
        node_extra += ["--tuning", a.node_tuning]
        summary["node_tuning"] = a.node_tuning
    if a.vllm_mtp:
        vspec = {"method": "mtp", "num_speculative_tokens": a.num_speculative_tokens,
                 "rejection_sample_method": "synthetic", "synthetic_acceptance_length": a.acceptance_length}
        summary.update({"acceptance_length": a.acceptance_length, "baseline_speculative_config": vspec,
                        "vllm_mtp": {}})
    if spec:
        # vLLM's synthetic rejection sampler and the node's --speculative-synthetic-acceptance: the same schedule
        vspec = {"method": "mtp", "num_speculative_tokens": a.num_speculative_tokens,
                 "rejection_sample_method": "synthetic", "synthetic_acceptance_length": a.acceptance_length}
        node_extra += ["--speculative", "mtp", "--num-speculative-tokens", str(a.num_speculative_tokens),
                      "--speculative-synthetic-acceptance", str(a.acceptance_length)]
        node_extra += draft
        summary.update({"speculative": "mtp", "num_speculative_tokens": a.num_speculative_tokens,
                        "draft_weights": a.draft_weights,
                        "acceptance_length": a.acceptance_length, "baseline_speculative_config": vspec,
                        "node_speculative_flags": node_extra, "vllm_mtp": {}})
    summary["hw"] = "cpu"
    if a.device == "cuda":
        import torch
        summary["hw"] = torch.cuda.get_device_name()
    hw = "h200" if "H200" in summary["hw"] else summary["hw"].lower().replace(" ", "-")
    out_json = os.path.join(a.out, f"gpu_e2e_{label}.json")

    def record(path: str, sc: str, conc: int, res: dict) -> None:
        if conc == 1:
            summary[path][sc] = res
        if sweep:
            summary["concurrency"].setdefault(path, {}).setdefault(sc, {})[str(conc)] = res

    def save():
        with open(out_json, "w") as f:
            json.dump(summary, f, indent=1)
        # the raw + agg files so far: a run cut short keeps what it measured
        with tarfile.open(os.path.join(a.out, f"gpu_e2e_{label}_raw.tar.gz"), "w:gz") as t:
            if os.path.isdir(res_dir):
                t.add(res_dir, arcname=f"gpu_e2e_{label}")

    stack = Stack(work, a.device, a.tp)
    t0 = time.monotonic()
    ix = (a.ix_scenarios if a.ix_scenarios is not None else a.scenarios) if a.ix_client else ()
    ix_n = a.ix_num_prompts or a.num_prompts
    purl = murl = None
    try:
        if "nexrt" in a.paths:
            # One at a time: vLLM sizes its KV cache from the memory it sees while profiling, which a
            # neighbour still allocating would falsify.
            ready = asyncio.run(stack.node(model, max_len, a.transport, a.recv_memory, node_extra))
            node = asyncio.run(wait_file(ready, stack.procs, a.start_timeout, "decode node"))
            summary["node_start_s"] = time.monotonic() - t0
            if a.concurrent_baseline and "vllm" in a.paths:
                # Each with a fixed KV cache, one after the other: vLLM checks the GPU's free memory as it
                # starts, which a neighbour starting at the same time moves (a third vLLM, + MTP, started with
                # the other two did not come up on an H200; the cause was not in the log kept then).
                kv = None if a.device == "cpu" else a.kv_cache_gib << 30
                vurl = stack.vllm("vllm", model, max_len, a.transport, share, kv)
                asyncio.run(_up(stack, [(vurl, "vLLM + connector")], a.start_timeout))
                purl = stack.vllm("vllm_plain", model, max_len, None, share, kv)
                asyncio.run(_up(stack, [(purl, "vLLM plain")], a.start_timeout))
                if "vllm_mtp" in a.paths:
                    murl = stack.vllm("vllm_mtp", model, max_len, None, share, kv, speculative=vspec)
                    asyncio.run(_up(stack, [(murl, "vLLM + MTP")], a.start_timeout))
            else:
                vurl = stack.vllm("vllm", model, max_len, a.transport, share)
                asyncio.run(_up(stack, [(vurl, "vLLM + connector")], a.start_timeout))
            rurl = stack.router(vurl, node["url"], model, queue=max(4, *a.conc))
            asyncio.run(_up(stack, [(rurl, "router")], 60))
            summary["startup_s"] = time.monotonic() - t0
            log(f"stack up in {summary['startup_s']:.0f}s")
            for sc in a.scenarios:
                for conc in a.conc:
                    before = scrape(node["url"])
                    baselines = ({"vllm": purl, **({"vllm_mtp": murl} if "vllm_mtp" in a.paths else {})}
                                 if a.interleave else None)
                    res = inferencex(rurl, "nexrt", "model", model, sc, a.num_prompts, res_dir, [], a.transport, hw,
                                     interleave=baselines, conc=conc)
                    record("nexrt", sc, conc, res["nexrt"])
                    for k in baselines or ():
                        summary[k][sc] = res[k]
                    key = sc if conc == 1 else f"{sc}_conc{conc}"
                    summary["node"][key] = node_delta(before, scrape(node["url"]))
                    log(sc, conc, res, summary["node"][key])
                    save()
            for sc in ix:
                summary.setdefault("inferencex_client", {}).setdefault("nexrt", {})[sc] = ix_client(
                    a.ix_client, rurl, model, sc, ix_n, os.path.join(res_dir, "ix"), "nexrt")
                save()
        if "vllm" in a.paths:
            if purl is None:
                stack.procs.stop()
                stack = Stack(work, a.device, a.tp)
                purl = stack.vllm("vllm_plain", model, max_len, None, alone_share)
                asyncio.run(_up(stack, [(purl, "vLLM plain")], a.start_timeout))
            for sc in ([] if a.interleave else a.scenarios):
                for conc in a.conc:
                    record("vllm", sc, conc, inferencex(purl, "vllm", "model", model, sc, a.num_prompts, res_dir, [],
                                                        "", hw, conc=conc)["vllm"])
                    log(sc, conc, "vllm", summary["vllm"].get(sc))
                    save()
        if "vllm_mtp" in a.paths and not a.interleave:
            if murl is None:  # one vLLM at a time: plain (if asked), then + MTP alone
                stack.procs.stop()
                stack = Stack(work, a.device, a.tp)
                murl = stack.vllm("vllm_mtp", model, max_len, None, alone_share, speculative=vspec)
                asyncio.run(_up(stack, [(murl, "vLLM + MTP")], a.start_timeout))
            # else started beside the others (--concurrent-baseline): measured now, the others idle
            for sc in a.scenarios:
                for conc in a.conc:
                    record("vllm_mtp", sc, conc, inferencex(murl, "vllm_mtp", "model", model, sc, a.num_prompts,
                                                            res_dir, [], "", hw, conc=conc)["vllm_mtp"])
                    log(sc, conc, "vllm_mtp", summary["vllm_mtp"].get(sc))
                    save()
            for sc in ix:
                summary.setdefault("inferencex_client", {}).setdefault("vllm", {})[sc] = ix_client(
                    a.ix_client, purl, model, sc, ix_n, os.path.join(res_dir, "ix"), "vllm")
                save()
        if a.concurrent_baseline and "nexrt" in a.paths and "vllm" in a.paths and a.breakdown_prompts:
            summary["ttft_breakdown"] = {
                sc: asyncio.run(ttft_breakdown({"nexrt": rurl, "vllm_plain": purl, "vllm_connector": vurl},
                                               model, *scenario(sc), a.breakdown_prompts))
                for sc in a.scenarios}
            log("ttft breakdown", json.dumps({sc: [b["median_ms"], b["after_decode"]["median_ms"]]
                                              for sc, b in summary["ttft_breakdown"].items()}))
            save()
    except Exception as e:  # noqa: BLE001 - keep what was measured
        summary["error"] = f"{type(e).__name__}: {e}"
        for name, _, logf in stack.procs.procs:
            with open(logf, errors="replace") as f:
                summary.setdefault("logs", {})[name] = f.read()[-4000:]
        log("FAILED", summary["error"])
    finally:
        stack.procs.stop()
        save()
    if not a.skip_engine_bench and a.device == "cuda" and "error" not in summary:
        ctxs = sorted({scenario(s)[0] for s in a.scenarios})
        summary["engine"] = engine_step(a.shape, ctxs, a.layers, os.path.join(work, "decode_bench.json"),
                                        a.num_speculative_tokens if spec else 0, a.tp,
                                        draft if spec else None)
    add_ratios(summary, a.scenarios)
    if sweep:
        add_sweep(summary, a.scenarios, os.path.join(a.out, f"gpu_e2e_{label}_pareto.png"))
    save()
    log("summary", json.dumps({k: summary.get(k) for k in ("ratios", "error")}))
    return 1 if "error" in summary else 0


if __name__ == "__main__":
    sys.exit(main())
