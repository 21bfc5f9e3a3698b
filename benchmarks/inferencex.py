"""InferenceX-compatible serving benchmark for any OpenAI-compatible endpoint: the CLI of
`nexrt_vllm.bench.inferencex` (InferenceX's client rules and metric definitions, ported).

    python benchmarks/inferencex.py run --base-url http://127.0.0.1:8000 --model M --tokenizer DIR \
        --scenario 8k1k --conc 1 2 4 --result-dir out/ --label nexrt --decode-gpus 1 --prefill-gpus 1
    python benchmarks/inferencex.py agg RAW.json --isl 8192 --osl 1024 --tp 8   # official client output
    python benchmarks/plot_pareto.py --series nexrt='out/nexrt/agg_*.json' --out pareto.png

Deliberate deviations from InferenceX (each makes a broken response count as failed rather than as a
fast success; none changes a metric of a healthy stream) are listed in docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import sys
from typing import Optional

from nexrt_vllm.bench.inferencex import (BACKENDS, CHAT_BACKENDS, MIN_PROMPTS, RANGE_RATIO, SCENARIOS, BenchmarkError,
                                         BenchmarkFailed, Identity, PromptTokenizer, RunConfig, check_failure_rate,
                                         make_agg, print_summary, raw_result, run_closed_loop, run_interleaved,
                                         sample_random_requests, wait_ready, write_json)
from nexrt_vllm.bench.pareto import load_series, plot_pareto


def _identity_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("aggregate identity (process_result.py's environment)")
    g.add_argument("--hw", default="cpu", help="hardware label (RUNNER_TYPE)")
    g.add_argument("--image", default="")
    g.add_argument("--framework", default="vllm")
    g.add_argument("--precision", default="bf16")
    g.add_argument("--spec-decoding", default="none")
    g.add_argument("--model-prefix", default="")
    g.add_argument("--recipe-fingerprint", default="")
    g.add_argument("--router-name", default="", help="with --router-version: agg `router` field")
    g.add_argument("--router-version", default="")
    g.add_argument("--kv-p2p-transfer", default="", help="e.g. mooncake, nixl")
    g.add_argument("--tp", type=int, default=1, help="single node: GPUs = tp * pp * pcp")
    g.add_argument("--pp", type=int, default=1)
    g.add_argument("--dcp", type=int, default=1)
    g.add_argument("--pcp", type=int, default=1)
    g.add_argument("--ep", type=int, default=1)
    g.add_argument("--dp-attention", default="false")
    g.add_argument("--prefill-gpus", type=int, default=0,
                   help="disaggregated: GPUs of the prefill pool (total/ (P+D), input / P)")
    g.add_argument("--decode-gpus", type=int, default=0,
                   help="disaggregated: GPUs of the decode pool (output / D)")
    g.add_argument("--prefill-tp", type=int, default=0)
    g.add_argument("--decode-tp", type=int, default=0)
    g.add_argument("--prefill-ep", type=int, default=1)
    g.add_argument("--decode-ep", type=int, default=1)
    g.add_argument("--prefill-workers", type=int, default=1)
    g.add_argument("--decode-workers", type=int, default=1)


def identity_from_args(a: argparse.Namespace) -> Identity:
    if bool(a.router_name) != bool(a.router_version):
        raise BenchmarkError("--router-name and --router-version go together")
    if a.decode_gpus and not a.prefill_gpus:
        raise BenchmarkError("--decode-gpus needs --prefill-gpus (disaggregated topology)")
    return Identity(
        hw=a.hw, image=a.image, framework=a.framework, precision=a.precision,
        spec_decoding=a.spec_decoding, model_prefix=a.model_prefix,
        recipe_fingerprint=a.recipe_fingerprint,
        router={"name": a.router_name, "version": a.router_version} if a.router_name else None,
        kv_p2p_transfer=a.kv_p2p_transfer, tp=a.tp, pp=a.pp, dcp=a.dcp, pcp=a.pcp, ep=a.ep,
        dp_attention=a.dp_attention, prefill_gpus=a.prefill_gpus, decode_gpus=a.decode_gpus,
        prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, prefill_ep=a.prefill_ep,
        decode_ep=a.decode_ep, prefill_workers=a.prefill_workers, decode_workers=a.decode_workers)


def _parse_kv(items: list[str], what: str) -> dict:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise BenchmarkError(f"invalid {what} {item!r}: use KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def cmd_run(a: argparse.Namespace) -> int:
    if a.scenario:
        isl, osl = SCENARIOS[a.scenario]
    elif a.isl and a.osl:
        isl, osl = a.isl, a.osl
    else:
        raise BenchmarkError("give --scenario 1k1k|8k1k or both --isl and --osl")
    if any(c < 1 for c in a.conc):
        raise BenchmarkError(f"--conc values must be >= 1, got {a.conc}")
    ident = identity_from_args(a)
    headers = _parse_kv(a.header, "--header")
    metadata = _parse_kv(a.metadata, "--metadata")
    endpoint = a.endpoint or ("/v1/chat/completions" if a.backend in CHAT_BACKENDS
                              else "/v1/completions")
    base_url = a.base_url.rstrip("/")
    tokenizer = PromptTokenizer(a.tokenizer)
    if a.ready_timeout > 0:
        asyncio.run(wait_ready(base_url, a.ready_timeout))
    label = a.label or a.backend
    out_dir = os.path.join(a.result_dir, label)
    os.makedirs(out_dir, exist_ok=True)
    agg_paths = []
    if a.interleave:
        return _run_interleaved(a, ident, headers, metadata, endpoint, base_url, tokenizer, label, isl, osl)
    for conc in a.conc:
        num_prompts = a.num_prompts or max(10 * conc, MIN_PROMPTS)
        num_warmups = 2 * conc if a.num_warmups is None else a.num_warmups
        requests = sample_random_requests(tokenizer, isl, osl, num_prompts, a.range_ratio,
                                          a.seed, a.use_chat_template)
        cfg = RunConfig(backend=a.backend, api_url=base_url + endpoint,
                        model=a.served_model_name or a.model, model_id=a.model,
                        tokenizer_id=a.tokenizer, max_concurrency=conc, num_warmups=num_warmups,
                        headers=headers, disable_tqdm=a.disable_tqdm)
        bench = asyncio.run(run_closed_loop(cfg, requests, tokenizer))
        raw = raw_result(cfg, num_prompts, bench, metadata, a.save_detailed)
        name = f"{label}_isl{isl}_osl{osl}_conc{conc}"
        write_json(os.path.join(out_dir, f"{name}.json"), raw)
        print_summary(raw)
        check_failure_rate(raw["completed"], num_prompts)
        agg_path = os.path.join(out_dir, f"agg_{name}.json")
        write_json(agg_path, make_agg(raw, ident, isl, osl))
        agg_paths.append(agg_path)
        print(f"wrote {os.path.join(out_dir, name + '.json')} and {agg_path}")
    if a.plot:
        series = {label: load_series(agg_paths)}
        for spec in a.overlay or []:
            other, _, pattern = spec.partition("=")
            series[other] = load_series(sorted(glob.glob(pattern)))
        plot_pareto(series, a.plot, title=f"ISL {isl} / OSL {osl}")
        print(f"wrote {a.plot}")
    return 0


def _run_interleaved(a, ident: Identity, headers: dict, metadata: dict, endpoint: str, base_url: str,
                     tokenizer: PromptTokenizer, label: str, isl: int, osl: int) -> int:
    """`run --interleave LABEL=URL ...`: this endpoint and the others, request by request."""
    import dataclasses

    if a.conc != [1]:
        raise BenchmarkError("--interleave runs at --conc 1 only")
    paths = [(label, base_url, ident)]
    for spec in a.interleave:
        other, sep, url = spec.partition("=")
        if not sep or not other or not url.startswith("http"):
            raise BenchmarkError(f"--interleave {spec!r}: use LABEL=http://HOST:PORT")
        paths.append((other, url.rstrip("/"), dataclasses.replace(
            ident, kv_p2p_transfer=a.interleave_kv_p2p_transfer, router=None)))
    if len({p[0] for p in paths}) != len(paths):
        raise BenchmarkError("--interleave labels must differ from each other and from --label")
    if a.ready_timeout > 0:
        for _, url, _ in paths[1:]:
            asyncio.run(wait_ready(url, a.ready_timeout))
    num_prompts = a.num_prompts or MIN_PROMPTS
    num_warmups = 2 if a.num_warmups is None else a.num_warmups
    requests = sample_random_requests(tokenizer, isl, osl, num_prompts, a.range_ratio, a.seed,
                                      a.use_chat_template)
    cfgs = [RunConfig(backend=a.backend, api_url=url + endpoint, model=a.served_model_name or a.model,
                      model_id=a.model, tokenizer_id=a.tokenizer, max_concurrency=1, num_warmups=num_warmups,
                      headers=headers, disable_tqdm=a.disable_tqdm) for _, url, _ in paths]
    benches = asyncio.run(run_interleaved(cfgs, requests, tokenizer))
    failed = []
    for (name, _, idt), cfg, bench in zip(paths, cfgs, benches):
        raw = raw_result(cfg, num_prompts, {**bench, "interleaved_with": [p[0] for p in paths if p[0] != name]},
                         metadata, a.save_detailed)
        out_dir = os.path.join(a.result_dir, name)
        os.makedirs(out_dir, exist_ok=True)
        stem = f"{name}_isl{isl}_osl{osl}_conc1"
        write_json(os.path.join(out_dir, f"{stem}.json"), raw)
        write_json(os.path.join(out_dir, f"agg_{stem}.json"), make_agg(raw, idt, isl, osl))
        print_summary(raw)
        print(f"wrote {os.path.join(out_dir, stem + '.json')} and its agg_")
        try:
            check_failure_rate(raw["completed"], num_prompts)
        except BenchmarkFailed as e:
            failed.append(f"{name}: {e}")
    if failed:
        raise BenchmarkFailed("; ".join(failed))
    return 0


def cmd_agg(a: argparse.Namespace) -> int:
    with open(a.raw) as f:
        raw = json.load(f)
    for key in ("max_concurrency", "model_id", "total_token_throughput", "output_throughput"):
        if key not in raw:
            raise BenchmarkError(f"{a.raw}: not a benchmark_serving result (no {key!r})")
    out = a.out or os.path.join(os.path.dirname(a.raw) or ".", "agg_" + os.path.basename(a.raw))
    write_json(out, make_agg(raw, identity_from_args(a), a.isl, a.osl))
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.inferencex", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run a concurrency sweep; write raw + agg JSON (+ plot)")
    r.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    r.add_argument("--backend", choices=BACKENDS, default="openai",
                   help="openai-chat -> /v1/chat/completions; the others -> /v1/completions")
    r.add_argument("--endpoint", default=None)
    r.add_argument("--model", required=True, help="model id recorded in the results")
    r.add_argument("--served-model-name", default=None, help="`model` field sent (default --model)")
    r.add_argument("--tokenizer", required=True, help="dir with tokenizer.json, or the file")
    r.add_argument("--scenario", choices=sorted(SCENARIOS), default=None)
    r.add_argument("--isl", type=int, default=0, help="custom input length (with --osl)")
    r.add_argument("--osl", type=int, default=0)
    r.add_argument("--range-ratio", type=float, default=RANGE_RATIO)
    r.add_argument("--conc", type=int, nargs="+", default=[1], help="concurrency sweep")
    r.add_argument("--num-prompts", type=int, default=0,
                   help=f"default max(10*conc, {MIN_PROMPTS}); smaller only for smoke runs")
    r.add_argument("--num-warmups", type=int, default=None, help="default 2*conc")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--use-chat-template", action="store_true")
    r.add_argument("--header", nargs="*", default=[], help="extra HTTP headers KEY=VALUE")
    r.add_argument("--metadata", nargs="*", default=[], help="KEY=VALUE into the raw JSON")
    r.add_argument("--result-dir", default="results")
    r.add_argument("--label", default=None, help="run name: subdir and file prefix (default backend)")
    r.add_argument("--save-detailed", action="store_true", help="keep per-request ttfts/itls/texts")
    r.add_argument("--ready-timeout", type=float, default=60.0, help="wait for /health (0: skip)")
    r.add_argument("--disable-tqdm", action="store_true")
    r.add_argument("--plot", default=None, help="PNG path: throughput/GPU vs interactivity")
    r.add_argument("--overlay", nargs="*", default=[],
                   help="LABEL=GLOB of earlier agg_*.json files to draw on the same plot")
    r.add_argument("--interleave", nargs="*", default=[], metavar="LABEL=URL",
                   help="also measure these endpoints, request by request with this one (conc 1; the same "
                        "prompts, the order rotated each prompt), each written under its own label")
    r.add_argument("--interleave-kv-p2p-transfer", default="",
                   help="the --interleave endpoints' agg kv_p2p_transfer (their router field is empty)")
    _identity_args(r)
    r.set_defaults(func=cmd_run)

    g = sub.add_parser("agg", help="agg_*.json from a raw result (e.g. of the official client)")
    g.add_argument("raw")
    g.add_argument("--isl", type=int, required=True)
    g.add_argument("--osl", type=int, required=True)
    g.add_argument("--out", default=None)
    _identity_args(g)
    g.set_defaults(func=cmd_agg)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (BenchmarkError, BenchmarkFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
