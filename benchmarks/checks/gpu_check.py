"""One-call GPU check: the GPU product checks, then optionally the decode benchmark.

    python benchmarks/checks/gpu_check.py --out OUT [--trained-parity] [--sampling] [--bench-args "..."]

1. the kernel tests (tests/engine/test_kernels_decode_ops.py) on the GPU: compiled kernels, random inputs,
   poisoned outputs, relative-error bounds; again with PDL on (NEXRT_PDL=1);
2. greedy parity on the tiny test checkpoints (all three families): eager engine vs the graph path
   (fused kernels, and eager ops in one graph) for 256 steps, replays per token; the same through
   the product wiring (Engine.use_graph + Engine.stream, as nexrt-decode --graph runs it);
3. optionally greedy parity on tiny checkpoints trained to continue periodic text (confident tokens);
4. optionally the sampling graph (support of every draw, seed reproducibility, step time);
5. optionally (--fp8) the FP8 path on the trained tiny checkpoints quantized as the published FP8
   checkpoints: the fused fp8 graph's greedy tokens against the eager engine on the dequantized
   checkpoint, with the kernels' default numerics and with fp8_round_weights, and through the
   product wiring;
6. optionally benchmarks/decode_bench.py with the given arguments (`--dtype bf16,fp8`: both formats).
Everything lands in --out as JSON (gpu_check.json). Each claim is a recorded check (`judge`); the exit
status is 1 if any failed (nexrt_vllm.bench.checks), the benchmark's own failure included.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from nexrt_vllm.bench import step
from nexrt_vllm.bench.checks import finish, record, write
from nexrt_vllm.bench.shapes import SHAPES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
TINY_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # the model families of the tiny test checkpoints


def log(*a):
    print(*a, flush=True)


KERNEL_TESTS = {"bf16": ("test_kernels_decode_ops.py", "test_kernels_logprobs.py"), "fp8": ("test_kernels_fp8.py",),
                "spec": ("test_kernels_verify_gemv.py", "test_kernels_verify_attn_gdn.py",
                         "test_kernels_spec.py")}


def kernel_tests(out: str, pdl: bool = False, which: str = "all") -> dict:
    files = [f for k, fs in KERNEL_TESTS.items() if which in ("all", k) for f in fs]
    env = dict(os.environ, NEXRT_KERNEL_DEVICE="cuda", PYTHONPATH=ROOT, NEXRT_PDL="1" if pdl else "0")
    env.pop("TRITON_INTERPRET", None)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        *[os.path.join(ROOT, "tests", "engine", f) for f in files]],
                       env=env, capture_output=True, text=True, timeout=540)
    with open(os.path.join(out, f"kernel_tests{'_pdl' if pdl else ''}.log"), "w") as f:
        f.write(p.stdout + p.stderr)
    tail = (p.stdout.strip().splitlines() or [""])[-1]
    log(f"kernel tests on GPU (pdl={pdl}): rc={p.returncode} {tail} ({time.time() - t0:.0f}s)")
    if p.returncode:
        log(p.stdout[-3000:])
    return {"rc": p.returncode, "summary": tail, "files": files}


def eager_greedy(eng, prompt: list[int], steps: int):
    """Prefill `prompt`, then `steps` eager greedy decode steps: (first token, exported state before
    the decode as (n0, snap), the decoded tokens)."""
    first = int(torch.argmax(eng.prefill(prompt)))
    n0, snap = eng.export_state()
    ref, tok = [], first
    for _ in range(steps):
        tok = int(torch.argmax(eng.decode_step(tok)))
        ref.append(tok)
    return first, n0, snap, ref


def tiny_parity(steps: int) -> dict:
    from nexrt_vllm.engine import Engine
    from nexrt_vllm.engine.gpu.decoder import FusedDecoder
    from nexrt_vllm.engine.gpu.runner import GraphRunner
    from nexrt_vllm.testing import make_checkpoint

    out = {}
    for arch in TINY_ARCHS:
        with tempfile.TemporaryDirectory() as d:
            make_checkpoint(d, arch=arch, dtype="bfloat16")
            eng = Engine.from_pretrained(d, device="cuda", dtype="bfloat16", max_seq_len=steps + 64, progress=False)
        first, n0, snap, ref = eager_greedy(eng, [5, 17, 3, 99, 42, 7, 11, 23], steps)
        r = {"distinct_tokens": len(set(ref))}
        for mode in ("fused", "eager"):
            eng.import_state(n0, snap)
            try:
                runner = GraphRunner(FusedDecoder(eng.model, eng.state, mode=mode))
                toks = list(runner.generate(first, steps))
            except Exception as e:  # noqa: BLE001 - e.g. an eager op that cannot be captured
                r[mode] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            div = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), None)
            r[mode] = {"equal": toks == ref, "first_divergence": div,
                       "replays_per_token": runner.replays / len(toks), "control": runner.d.control,
                       "seq_len_after": eng.state.seq_len, "expected_seq_len": n0 + steps}
        # Engine.stream's contract: the graph runner's stream() against the engine's own
        from nexrt_vllm.engine import SamplingParams
        for sp in (SamplingParams(max_tokens=40), SamplingParams(max_tokens=300, stop_token_ids=(ref[5],)),
                   SamplingParams(max_tokens=40, stop_token_ids=(first,))):
            eng.import_state(n0, snap)
            want = list(eng.stream(first, sp))
            want_reason = eng.finish_reason
            eng.import_state(n0, snap)
            runner = GraphRunner(FusedDecoder(eng.model, eng.state, mode="eager"))
            got = list(runner.stream(first, sp))
            r.setdefault("stream_contract", []).append(
                {"max_tokens": sp.max_tokens, "equal": got == want, "n": len(got),
                 "finish_reason": [runner.finish_reason, want_reason]})
        # stop handling: a stop id ends the stream at its first occurrence; one overrun replay ran
        eng.import_state(n0, snap)
        runner = GraphRunner(FusedDecoder(eng.model, eng.state, mode="fused"))
        stop_toks = list(runner.generate(first, steps, stop_token_ids=[ref[3]]))
        r["stop"] = {"tokens": len(stop_toks), "expected": ref.index(ref[3]) + 1, "replays": runner.replays,
                     "prefix_equal": stop_toks == ref[:len(stop_toks)]}
        out[arch] = r
        log(f"tiny {arch}: {json.dumps(r)}")
        del eng
    return out


def trained_parity(steps: int, arch: str, checkpoints: str = "") -> dict:
    """Greedy parity, fused graph path vs the eager engine, on a tiny checkpoint of `arch` trained to
    continue periodic text (testing.make_checkpoint(train="periodic")): confident, context-decided
    tokens, so a difference means a wrong result rather than a near-tie flipped by summation order.
    `checkpoints/<arch>`, where it exists, is such a checkpoint trained beforehand (training takes
    2-5 min of the device's CPU per family); otherwise it is trained here."""
    from nexrt_vllm.engine import Engine
    from nexrt_vllm.engine.gpu.decoder import FusedDecoder
    from nexrt_vllm.engine.gpu.runner import GraphRunner
    from nexrt_vllm.testing import make_checkpoint

    t0 = time.time()
    pre = os.path.join(checkpoints, arch) if checkpoints else ""
    with tempfile.TemporaryDirectory() as d:
        if pre and os.path.isfile(os.path.join(pre, "config.json")):
            d = pre
        else:
            make_checkpoint(d, arch=arch, dtype="bfloat16", train="periodic")
        eng = Engine.from_pretrained(d, device="cuda", dtype="bfloat16", max_seq_len=steps + 128, progress=False)
    prompt, seg = step.periodic_prompt(eng.config.vocab_size)
    first, n0, snap, ref = eager_greedy(eng, prompt, steps)
    eng.import_state(n0, snap)
    runner = GraphRunner(FusedDecoder(eng.model, eng.state, mode="fused"))
    toks = list(runner.generate(first, steps))
    div = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), None)
    out = {"equal": toks == ref, "first_divergence": div, "steps": steps, "pretrained": d == pre,
           "continues_period": [first] + ref[:20] == [seg[(len(prompt) + i) % len(seg)] for i in range(21)],
           "replays_per_token": runner.replays / len(toks), "seconds": time.time() - t0}
    log(f"trained {arch}: {json.dumps(out)}")
    return out


def _trained(arch: str, checkpoints: str, d: str) -> str:
    pre = os.path.join(checkpoints, arch) if checkpoints else ""
    if pre and os.path.isfile(os.path.join(pre, "config.json")):
        return pre
    from nexrt_vllm.testing import make_checkpoint
    make_checkpoint(d, arch=arch, dtype="bfloat16", train="periodic")
    return d


def fp8_parity(steps: int, arch: str, checkpoints: str = "") -> dict:
    """The trained tiny `arch` checkpoint quantized as the published FP8 checkpoints are (128 x 128
    blocks; head, router, shared-expert gate, GDN b / a in bf16): greedy tokens of the fused fp8
    graph (weights kept e4m3, Engine.from_pretrained's default on CUDA) against the eager engine on
    the dequantized checkpoint (the CPU oracle's numerics), for `steps` tokens; the same with
    Tuning(fp8_round_weights=True) (the kernels round each weight like the oracle); the eager ops on
    the kept weights; and the product wiring (use_graph + stream)."""
    import dataclasses

    from nexrt_vllm.engine import Engine, SamplingParams
    from nexrt_vllm.engine.fp8 import PUBLISHED_NOT_CONVERT
    from nexrt_vllm.engine.gpu.decoder import FusedDecoder
    from nexrt_vllm.engine.gpu.runner import GraphRunner
    from nexrt_vllm.engine.gpu.tuning import Tuning
    from nexrt_vllm.testing import make_fp8_checkpoint

    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        src = _trained(arch, checkpoints, os.path.join(d, "src"))
        path = make_fp8_checkpoint(src, os.path.join(d, "fp8"), block=128, not_convert=PUBLISHED_NOT_CONVERT)
        kw = dict(device="cuda", dtype="bfloat16", max_seq_len=steps + 128, progress=False)
        eng = Engine.from_pretrained(path, **kw)
        deq = Engine.from_pretrained(path, fp8_weights="dequantize", **kw)
    prompt, seg = step.periodic_prompt(eng.config.vocab_size)
    first, n0, snap, ref = eager_greedy(deq, prompt, steps)
    del deq
    torch.cuda.empty_cache()
    out = {"steps": steps, "weight_format": eng.weight_format,
           "continues_period": [first] + ref[:20] == [seg[(len(prompt) + i) % len(seg)] for i in range(21)]}
    f2, _, _, ref_keep = eager_greedy(eng, prompt, steps)
    out["eager_on_kept_fp8_equal"] = f2 == first and ref_keep == ref
    for label, tuning in (("fused", Tuning()), ("fused_round_weights", dataclasses.replace(Tuning(), fp8_round_weights=True))):
        eng.import_state(n0, snap)
        runner = GraphRunner(FusedDecoder(eng.model, eng.state, mode="fused", tuning=tuning))
        toks = list(runner.generate(first, steps))
        out[label] = {"equal": toks == ref, "replays_per_token": runner.replays / len(toks),
                      "first_divergence": next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), None)}
        del runner
    eng.use_graph("fused")
    eng.import_state(n0, snap)
    got = list(eng.stream(first, SamplingParams(max_tokens=steps + 1, ignore_eos=True)))
    out["engine_stream"] = {"equal": got == ref, "finish_reason": eng.finish_reason, "n": len(got)}
    out["seconds"] = time.time() - t0
    log(f"fp8 {arch}: {json.dumps(out)}")
    del eng
    torch.cuda.empty_cache()
    return out


def engine_graph(steps: int) -> dict:
    """The product wiring: Engine.use_graph(mode) then Engine.stream (what nexrt-decode --graph runs),
    against the same engine's eager stream; greedy, a stop id, and a seeded sampled stream."""
    from nexrt_vllm.engine import Engine, SamplingParams
    from nexrt_vllm.testing import make_checkpoint

    out = {}
    for arch in TINY_ARCHS:
        with tempfile.TemporaryDirectory() as d:
            make_checkpoint(d, arch=arch, dtype="bfloat16")
            eng = Engine.from_pretrained(d, device="cuda", dtype="bfloat16", max_seq_len=steps + 64, progress=False)
        first = int(torch.argmax(eng.prefill([5, 17, 3, 99, 42, 7, 11, 23])))
        n0, snap = eng.export_state()
        greedy = SamplingParams(max_tokens=steps, ignore_eos=True)
        want = list(eng.stream(first, greedy))
        stop = SamplingParams(max_tokens=steps, stop_token_ids=(want[20],))
        eng.import_state(n0, snap)
        want_stop = list(eng.stream(first, stop))
        r = {}
        for mode in ("eager", "fused"):
            try:
                t0 = time.time()
                eng.use_graph(mode)
                r[mode] = {"capture_s": round(time.time() - t0, 2)}
                eng.import_state(n0, snap)
                got = list(eng.stream(first, greedy))
                r[mode].update(equal=got == want, n=len(got), finish_reason=eng.finish_reason,
                               first_divergence=next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None))
                eng.import_state(n0, snap)
                got = list(eng.stream(first, stop))
                r[mode]["stop"] = {"equal": got == want_stop, "n": len(got), "finish_reason": eng.finish_reason}
                sp = SamplingParams(max_tokens=32, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
                draws = []
                for _ in range(2):
                    eng.import_state(n0, snap)
                    draws.append(list(eng.stream(first, sp)))
                r[mode]["sampled_seed_repro"] = draws[0] == draws[1] and len(draws[0]) == 31
                r[mode]["replays"] = eng.graph.replays
            except Exception as e:  # noqa: BLE001 - report it, go on with the other mode
                r[mode] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            eng.graph = None
        out[arch] = r
        log(f"engine graph {arch}: {json.dumps(r)}")
        del eng
    return out


def spec_parity(steps: int, arch: str, checkpoints: str, tuning=None) -> dict:
    """Greedy tokens of the captured MTP round (`Engine.use_graph("fused")` with `enable_speculative`) ==
    the eager one-token loop for `steps` tokens, from the full prompt context (prefill) and after a
    hand-off (no head context); the acceptance length of the trained head; a stop id and a context
    too short for another round (the plain step graph finishes it)."""
    from nexrt_vllm.engine import Engine, SamplingParams

    path = os.path.join(checkpoints, arch) if checkpoints else None
    if not path or not os.path.isdir(path):
        from nexrt_vllm.testing import stored
        from nexrt_vllm.testing.recipes import TRAINED_MTP
        path = f"/tmp/nexrt_spec_{arch}"
        stored.place(path, arch, "bfloat16", TRAINED_MTP[arch])  # from the repository's store when it holds it
    max_len = 40 + steps + 16
    ref = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", max_seq_len=max_len, progress=False)
    eng = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", max_seq_len=max_len, progress=False)
    eng.enable_speculative("mtp", 3)
    t0 = time.time()
    eng.use_graph("fused", tuning=tuning)
    out = {"capture_s": time.time() - t0, "launches_per_round": len(eng.spec_graph.d.plan())}
    prompt = step.periodic_prompt(380, period=11)[0]  # what the tiny checkpoints were trained to continue
    sp = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    first = int(ref.prefill(prompt).argmax())
    want = list(ref.stream(first, sp))

    def run(handoff: bool):
        eng.speculative.rounds = [0] * 5
        eng.prefill(prompt)
        if handoff:
            eng.import_state(*eng.export_state())
        got = list(eng.stream(first, sp))
        r = eng.speculative.rounds
        div = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        return {"equal": got == want, "n": len(got), "first_divergence": div, "rounds": r,
                "acceptance_length": sum(i * c for i, c in enumerate(r)) / max(1, sum(r))}

    out["full_context"], out["handed_off"] = run(False), run(True)
    stop = want[20]
    eng.prefill(prompt)
    got = list(eng.stream(first, SamplingParams(max_tokens=steps + 1, stop_token_ids=(stop,))))
    out["stop"] = {"equal": got == want[:want.index(stop) + 1] and eng.finish_reason == "stop"}
    # the whole context: the last tokens come from the plain step graph (no room for a round)
    n_fit = max_len - len(prompt)
    eng.prefill(prompt)
    got = list(eng.stream(first, SamplingParams(max_tokens=n_fit + 10, ignore_eos=True)))
    ref.prefill(prompt)
    full = list(ref.stream(first, SamplingParams(max_tokens=n_fit + 10, ignore_eos=True)))
    out["full_context_window"] = {"equal": got == full, "n": len(got), "want_n": len(full),
                                  "finish_reason": eng.finish_reason}
    log(f"spec parity {arch}: {out}")
    return out


def sampling_check(steps: int = 64) -> dict:
    """The sampling graph (temperature / top-k / top-p on the device): every token drawn must lie in
    the support of the engine's own sampling distribution for the step's logits; a seed reproduces
    the stream, another seed changes it. Also times the sampling step at the 2B shape."""
    from nexrt_vllm.engine import Engine, sampling_probs
    from nexrt_vllm.engine.gpu.decoder import FusedDecoder
    from nexrt_vllm.engine.gpu.runner import GraphRunner
    from nexrt_vllm.testing import make_checkpoint

    out = {}
    with tempfile.TemporaryDirectory() as d:
        make_checkpoint(d, arch="qwen3_5", dtype="bfloat16")
        eng = Engine.from_pretrained(d, device="cuda", dtype="bfloat16", max_seq_len=4 * steps + 64, progress=False)
    first = int(torch.argmax(eng.prefill([5, 17, 3, 99, 42, 7, 11, 23])))
    n0, snap = eng.export_state()
    runner = GraphRunner(FusedDecoder(eng.model, eng.state))
    params = dict(temperature=0.8, top_p=0.9, top_k=20)
    streams = []
    for seed in (7, 7, 8):
        eng.import_state(n0, snap)
        streams.append(list(runner.generate(first, steps, seed=seed, **params)))
    out["same_seed_equal"] = streams[0] == streams[1]
    out["other_seed_differs"] = streams[0] != streams[2]
    out["distinct_tokens"] = len(set(streams[0]))
    # step by step: the drawn token must have non-zero probability under the eager sampler's rule
    eng.import_state(n0, snap)
    dec = runner.d
    g = runner.capture(True)
    dec.params.copy_(torch.tensor([params["temperature"], params["top_p"], float(params["top_k"])]))
    dec.seed.fill_(3)
    dec.tok.fill_(first)
    dec.state.position.fill_(n0)
    bad = 0
    for _ in range(steps):
        g.replay()
        torch.cuda.synchronize()
        probs = sampling_probs(dec.logits, params["temperature"], params["top_k"], params["top_p"])
        bad += int(probs[int(dec.tok)] <= 0)
    out["tokens_outside_support"] = bad
    eng.import_state(n0, snap)
    del eng, runner
    eng = Engine.from_config(SHAPES["2b"], device="cuda", dtype="bfloat16", max_seq_len=8192 + 512)
    step.fill_context(eng, 8192, torch.Generator(device="cuda").manual_seed(0))
    runner = GraphRunner(FusedDecoder(eng.model, eng.state))
    for sample in (False, True):
        gr = runner.capture(sample)
        eng.state.set_seq_len(8192)
        step.time_replays(gr, 5)
        eng.state.set_seq_len(8192)
        out[f"2b_8k_step_ms_{'sampling' if sample else 'greedy'}"] = \
            statistics.median(step.time_replays(gr, 100)) * 1e3
    log(f"sampling: {json.dumps(out)}")
    return out


def _ok(r) -> bool:
    """A section's result ran (no "error")."""
    return isinstance(r, dict) and "error" not in r


def judge(report: dict) -> None:
    """Record each claim of the sections in `report` as a check (nexrt_vllm.bench.checks), as docs/GPU.md
    ("Parity") states them. The fused graph on the random tiny checkpoints is held to its contracts
    (replays, sequence length, stop ids, the stream's finish reasons), not to the eager tokens: its
    near-tied logits flip with the summation order; the trained checkpoints' tokens must be equal."""
    for key in ("kernel_tests", "kernel_tests_pdl"):
        if key in report:
            record(report, key, report[key]["rc"] == 0)
    for arch, r in report.get("trained_parity", {}).items():
        record(report, f"trained_parity/{arch}", r["equal"] and r["continues_period"])
    tiny = report.get("tiny_parity", {})
    if "error" in tiny:
        record(report, "tiny_parity", False)
    for arch, r in ({} if "error" in tiny else tiny).items():
        for mode in ("fused", "eager"):
            m = r[mode]
            record(report, f"tiny_parity/{arch}/{mode}_contract",
                   _ok(m) and m["replays_per_token"] == 1 and m["seq_len_after"] == m["expected_seq_len"])
        record(report, f"tiny_parity/{arch}/eager_ops_tokens", _ok(r["eager"]) and r["eager"]["equal"])
        record(report, f"tiny_parity/{arch}/stream_contract",
               all(c["equal"] and c["finish_reason"][0] == c["finish_reason"][1] for c in r["stream_contract"]))
        record(report, f"tiny_parity/{arch}/stop", r["stop"]["prefix_equal"] and r["stop"]["tokens"] == r["stop"]["expected"])
    graph = report.get("engine_graph", {})
    if "error" in graph:
        record(report, "engine_graph", False)
    for arch, r in ({} if "error" in graph else graph).items():
        for mode, m in r.items():
            record(report, f"engine_graph/{arch}/{mode}",
                   _ok(m) and m["finish_reason"] == "length" and m["stop"]["equal"]
                   and m["stop"]["finish_reason"] == "stop" and m["sampled_seed_repro"]
                   and (mode != "eager" or m["equal"]))
    for arch, r in report.get("fp8_parity", {}).items():
        record(report, f"fp8_parity/{arch}",
               _ok(r) and r["continues_period"] and r["eager_on_kept_fp8_equal"] and r["fused"]["equal"]
               and r["fused_round_weights"]["equal"] and r["engine_stream"]["equal"])
    for arch, r in report.get("spec_parity", {}).items():
        record(report, f"spec_parity/{arch}",
               _ok(r) and all(r[k]["equal"] for k in ("full_context", "handed_off", "stop", "full_context_window")))
    if "sampling" in report:
        r = report["sampling"]
        record(report, "sampling", r["same_seed_equal"] and r["other_seed_differs"] and r["tokens_outside_support"] == 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--kernel-tests-only", action="store_true", help="of the tests, only the kernel tests")
    ap.add_argument("--kernel-tests", choices=("all", "bf16", "fp8", "spec"), default="all",
                    help="which kernel test files (fp8: tests/engine/test_kernels_fp8.py; spec: the speculative "
                         "round's, test_kernels_verify_*.py and test_kernels_spec.py)")
    ap.add_argument("--tiny-steps", type=int, default=256)
    ap.add_argument("--trained-parity", action="store_true", help="fused vs eager on trained tiny checkpoints")
    ap.add_argument("--checkpoints", default="", help="dir of <arch>/ checkpoints trained beforehand "
                    "(make_checkpoint(train='periodic')) for --trained-parity")
    ap.add_argument("--arches", default=",".join(TINY_ARCHS), help="families for --trained-parity")
    ap.add_argument("--sampling", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="the FP8 path on the trained tiny checkpoints (families: "
                    "--arches; --checkpoints to use ones trained beforehand)")
    ap.add_argument("--speculative", action="store_true", help="the captured MTP round (Engine.use_graph with "
                    "speculative decoding) against the eager one-token loop on trained tiny checkpoints with a "
                    "trained MTP head (--checkpoints: <arch>/ made with connector_harness.TRAINED_MTP)")
    ap.add_argument("--spec-tuning", default="", help="Tuning fields of the --speculative round graph "
                    "(decode_bench --tuning's form, e.g. round_attn_splits=64)")
    ap.add_argument("--bench-args", default="", help="then run benchmarks/decode_bench.py with these arguments")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_check.json")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save():  # after every section: a run cut short keeps what it did
        judge(report)
        write(report, path)

    if args.trained_parity:  # first: the longest and the one a cut-short run must not lose
        for arch in filter(None, args.arches.split(",")):
            report.setdefault("trained_parity", {})[arch] = trained_parity(args.tiny_steps, arch, args.checkpoints)
            save()
    if not args.skip_tests:
        report["kernel_tests"] = kernel_tests(args.out, which=args.kernel_tests)
        report["kernel_tests_pdl"] = kernel_tests(args.out, pdl=True, which=args.kernel_tests)
        save()
    if not args.skip_tests and not args.kernel_tests_only:
        for name, fn in (("tiny_parity", tiny_parity), ("engine_graph", engine_graph)):
            try:
                report[name] = fn(args.tiny_steps)
            except Exception as e:  # noqa: BLE001 - keep going to the bench; the report says what broke
                import traceback
                traceback.print_exc()
                report[name] = {"error": f"{type(e).__name__}: {e}"}
            save()
    spec_tuning = step.tuning_from(args.spec_tuning)[0] if args.spec_tuning else None
    if spec_tuning is not None:
        report["spec_tuning"] = args.spec_tuning
    for on, key, fn in ((args.fp8, "fp8_parity", fp8_parity),
                        (args.speculative, "spec_parity", functools.partial(spec_parity, tuning=spec_tuning))):
        for arch in filter(None, args.arches.split(",")) if on else ():
            try:
                report.setdefault(key, {})[arch] = fn(args.tiny_steps, arch, args.checkpoints)
            except Exception as e:  # noqa: BLE001 - report it, go on
                import traceback
                traceback.print_exc()
                report.setdefault(key, {})[arch] = {"error": f"{type(e).__name__}: {e}"}
            save()
    if args.sampling:
        report["sampling"] = sampling_check()
    if args.bench_args:  # its own process (and JSON, --json in the arguments); its exit status is a check here
        torch.cuda.empty_cache()
        cmd = [sys.executable, "-m", "benchmarks.decode_bench", *shlex.split(args.bench_args)]
        record(report, "decode_bench", subprocess.run(cmd, cwd=ROOT).returncode == 0)
    judge(report)
    return finish(report, path)


if __name__ == "__main__":
    sys.exit(main())
