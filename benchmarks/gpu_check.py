"""One-call GPU driver for the device machine: kernel checks, tiny-checkpoint parity, GEMV sweep, bench.

    PYTHONPATH=. python benchmarks/gpu_check.py --out $OUT [--sweep] [--bench-args "..."]

1. the kernel tests (tests/engine/test_kernels_decode_ops.py) on the GPU: compiled kernels, random inputs,
   poisoned outputs, relative-error bounds; again with PDL on (NEXRT_PDL=1);
2. greedy parity on the tiny test checkpoints (all three families): eager engine vs the graph path
   (fused kernels, and eager ops in one graph) for 256 steps, replays per token; the same through
   the product wiring (Engine.use_graph + Engine.stream, as nexrt-decode --graph runs it);
3. optionally a GEMV / MoE launch-shape sweep on the real projection shapes (bandwidth per config);
4. optionally the sampling graph (support of every draw, seed reproducibility, step time);
5. optionally benchmarks/decode_bench.py with the given arguments;
6. optionally (--ab SHAPES) an A/B of Tuning variants at 8K in one process: step time, greedy tokens,
   kernel-group times of the fastest (default variants: PDL off / on).
Everything lands in --out as JSON; a short table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # the model families of the tiny test checkpoints


def log(*a):
    print(*a, flush=True)


def kernel_tests(out: str, pdl: bool = False) -> dict:
    env = dict(os.environ, NEXRT_KERNEL_DEVICE="cuda", PYTHONPATH=ROOT, NEXRT_PDL="1" if pdl else "0")
    env.pop("TRITON_INTERPRET", None)
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(ROOT, "tests", "tests/engine/test_kernels_decode_ops.py"),
                        os.path.join(ROOT, "tests", "tests/gpu/test_csrc_moe_decode.py")],
                       env=env, capture_output=True, text=True, timeout=400)
    with open(os.path.join(out, f"kernel_tests{'_pdl' if pdl else ''}.log"), "w") as f:
        f.write(p.stdout + p.stderr)
    tail = (p.stdout.strip().splitlines() or [""])[-1]
    log(f"kernel tests on GPU (pdl={pdl}): rc={p.returncode} {tail} ({time.time() - t0:.0f}s)")
    if p.returncode:
        log(p.stdout[-3000:])
    return {"rc": p.returncode, "summary": tail}


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
    from nexrt_vllm.engine.graph import FusedDecoder, GraphRunner
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
    import decode_bench as db

    from nexrt_vllm.engine import Engine
    from nexrt_vllm.engine.graph import FusedDecoder, GraphRunner
    from nexrt_vllm.testing import make_checkpoint

    t0 = time.time()
    pre = os.path.join(checkpoints, arch) if checkpoints else ""
    with tempfile.TemporaryDirectory() as d:
        if pre and os.path.isfile(os.path.join(pre, "config.json")):
            d = pre
        else:
            make_checkpoint(d, arch=arch, dtype="bfloat16", train="periodic")
        eng = Engine.from_pretrained(d, device="cuda", dtype="bfloat16", max_seq_len=steps + 128, progress=False)
    prompt, seg = db.periodic_prompt(eng.config.vocab_size)
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


DEFAULT_AB = "off:pdl=0;pdl:pdl=1;off_again:pdl=0"


def parse_variants(spec: str) -> list[tuple[str, dict]]:
    """"label:field=value,...;label2:..." -> [(label, Tuning overrides)] (values as decode_bench.tuning_from)."""
    sys.path.insert(0, HERE)
    import decode_bench as db
    return [(label, db.tuning_from(kvs)[1]) for label, _, kvs in
            (part.partition(":") for part in filter(None, spec.split(";")))]


def kernel_timeline(g, reps: int = 12) -> dict:
    """Kernel-level trace (CUPTI, via torch.profiler) of `reps` replays of the step graph `g`: per
    kernel of the step, the median duration and the median idle gap before it (end of the previous
    kernel to its start), in launch order, and the totals by kernel name. Shows where a step loses
    time between kernels rather than inside them."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    ev = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type != torch.autograd.DeviceType.CPU and "memcpy" not in e.name.lower()
                 and "memset" not in e.name.lower()), key=lambda x: x[0])
    if not ev or len(ev) % reps:
        return {"error": f"{len(ev)} kernel events for {reps} replays"}
    n = len(ev) // reps
    rows = []
    for i in range(n):
        durs = [ev[r * n + i][1] - ev[r * n + i][0] for r in range(reps)]
        gaps = [ev[r * n + i][0] - ev[r * n + i - 1][1] for r in range(reps)] if i else []
        rows.append({"name": ev[i][2], "us": statistics.median(durs),
                     "gap_before_us": statistics.median(gaps) if gaps else 0.0})
    by_name: dict = {}
    for r in rows:
        a = by_name.setdefault(r["name"], {"count": 0, "us": 0.0, "gap_us": 0.0})
        a["count"] += 1
        a["us"] += r["us"]
        a["gap_us"] += r["gap_before_us"]
    span = [ev[r * n + n - 1][1] - ev[r * n][0] for r in range(reps)]
    return {"kernels_per_step": n, "span_us_median": statistics.median(span),
            "sum_kernel_us": sum(r["us"] for r in rows), "sum_gap_us": sum(r["gap_before_us"] for r in rows),
            "by_name": by_name, "kernels": rows}


def tuning_ab(shape: str, variants: list[tuple[str, dict]], ctx: int = 8192, steps: int = 200,
              check_steps: int = 32, breakdown: bool = True, timeline: bool = False) -> dict:
    """One model of `shape` at `ctx`; per Tuning variant (fields replaced, ints as bools where the
    field is bool): median step time over `steps` replays, greedy tokens from one state (variants
    that only change launch options must give the same tokens) and, for the fastest variant, the
    per-kernel-group times; with `timeline`, a CUPTI kernel trace of every variant (`kernel_timeline`).
    A repeated variant shows the drift between measurements."""
    import dataclasses

    sys.path.insert(0, HERE)
    import decode_bench as db
    from nexrt_vllm.engine import Engine
    from nexrt_vllm.engine.graph import FusedDecoder, GraphRunner, Tuning

    eng = Engine.from_config(db.SHAPES[shape], device="cuda", dtype="bfloat16", max_seq_len=ctx + 2 * steps + 64,
                             seed=0)
    db.fill_context(eng, ctx, torch.Generator(device="cuda").manual_seed(1234))
    n0, snap = eng.export_state()
    out = {"shape": shape, "context": ctx, "steps": steps, "variants": {}}
    best = None
    for label, kw in variants:
        tuning = dataclasses.replace(Tuning(), **kw)
        d = FusedDecoder(eng.model, eng.state, mode="fused", tuning=tuning)
        runner = GraphRunner(d)
        g = runner._graph(False)
        d.state.position.fill_(ctx)
        d.tok.fill_(1)
        db.time_replays(g, 5)
        d.state.position.fill_(ctx)
        med = statistics.median(db.time_replays(g, steps))
        tl_ = None
        if timeline:
            d.state.position.fill_(ctx)
            try:
                tl_ = kernel_timeline(g)
            except Exception as e:  # noqa: BLE001 - a trace failure must not lose the A/B
                tl_ = {"error": f"{type(e).__name__}: {e}"}
            log(f"timeline {shape} {label}: "
                + json.dumps({k: v for k, v in tl_.items() if k not in ("kernels", "by_name")}))
        eng.import_state(n0, snap)
        toks = list(runner.generate(1, check_steps))
        eng.import_state(n0, snap)
        out["variants"][label] = {"tuning": kw, "moe_impl": d.moe_impl, "step_ms_median": med * 1e3, "tokens": toks,
                                  "timeline": tl_, "mbu": d.bytes_per_step(ctx)["total"] / med / db.copy_bw_cached()}
        log(f"A/B {shape}@{ctx} {label} {kw}: {med * 1e3:.3f} ms/step, MBU {out['variants'][label]['mbu'] * 100:.1f}%")
        if best is None or med < best[1]:
            best = (label, med, d)
        del runner, g
    if breakdown and best is not None:
        eng.state.set_seq_len(ctx)
        out["kernel_groups_best"] = {"variant": best[0], "groups": db.kernel_groups(best[2])}
        eng.import_state(n0, snap)
    first = next(iter(out["variants"].values()))["tokens"]
    out["tokens_equal_to_first"] = {k: v["tokens"] == first for k, v in out["variants"].items()}
    del eng, best
    torch.cuda.empty_cache()
    return out


def sampling_check(steps: int = 64) -> dict:
    """The sampling graph (temperature / top-k / top-p on the device): every token drawn must lie in
    the support of the engine's own sampling distribution for the step's logits; a seed reproduces
    the stream, another seed changes it. Also times the sampling step at the 2B shape."""
    from nexrt_vllm.engine import Engine, sampling_probs
    from nexrt_vllm.engine.graph import FusedDecoder, GraphRunner
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
    g = runner._graph(True)
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
    sys.path.insert(0, HERE)
    import decode_bench
    eng = Engine.from_config(decode_bench.SHAPES["2b"], device="cuda", dtype="bfloat16", max_seq_len=8192 + 512)
    decode_bench.fill_context(eng, 8192, torch.Generator(device="cuda").manual_seed(0))
    runner = GraphRunner(FusedDecoder(eng.model, eng.state))
    for sample in (False, True):
        gr = runner._graph(sample)
        eng.state.set_seq_len(8192)
        decode_bench.time_replays(gr, 5)
        eng.state.set_seq_len(8192)
        out[f"2b_8k_step_ms_{'sampling' if sample else 'greedy'}"] = \
            statistics.median(decode_bench.time_replays(gr, 100)) * 1e3
    log(f"sampling: {json.dumps(out)}")
    return out


MOE_35B = (2048, 256, 8, 512, 512)  # H, E, top_k, I, Is of Qwen3.5-35B-A3B


def _moe_weights(g=None) -> dict:
    """Random bf16 MoE-block weights at the 35B-A3B shape, scaled so activations stay O(1)."""
    H, E, K, I, Is = MOE_35B
    r = lambda *sh, sc: (torch.randn(*sh, generator=g, device="cuda") * sc).to(torch.bfloat16)  # noqa: E731
    return dict(ln=r(H, sc=0.1), wr=r(E + 1, H, sc=3 * H ** -0.5), gu=r(E, 2 * I, H, sc=H ** -0.5),
                dn=r(E, H, I, sc=I ** -0.5), sgu=r(2 * Is, H, sc=H ** -0.5), sdn=r(H, Is, sc=Is ** -0.5))


def moe_profile(layers: int = 40, n_weights: int = 8) -> dict:
    """The 35B-A3B MoE block alone: the CUDA kernel vs the Triton pair (router GEMV + experts), each
    as `layers` launches over `n_weights` rotated weight sets in one graph (per-layer µs), and the
    CUDA kernel's phase timeline (per-CTA %globaltimer stamps, µs from the first CTA's start)."""
    from nexrt_vllm.engine import cuda_kernels as ck
    from nexrt_vllm.engine.kernels import gemv, moe

    H, E, K, I, Is = MOE_35B
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(5)
    W = [_moe_weights(g) for _ in range(n_weights)]
    res = torch.randn(H, generator=g, device=dev).to(bf)
    res0 = res.clone()
    logits = torch.zeros(E + 1, dtype=bf, device=dev)
    act = torch.zeros((K + 1) * I, dtype=bf, device=dev)
    ids = torch.zeros(K, dtype=torch.int32, device=dev)
    wts = torch.zeros(K, dtype=torch.float32, device=dev)
    xn = torch.zeros(H, dtype=bf, device=dev)
    kerns = {v: ck.MoeDecode(dev, H, E, K, I, Is, defines=(v,) if v else ()) for v in ("", "NEXRT_MOE_NO_COMPUTE",
                                                                                   "NEXRT_MOE_NO_LOAD")}
    kern = kerns[""]
    nbytes = 2 * (E + 1) * H + K * 3 * I * H * 2 + 3 * Is * H * 2

    def cuda_step(w, prof=None, kern=kern):
        kern.launch(res, w["ln"], w["wr"], w["gu"], w["dn"], w["sgu"], w["sdn"], logits, act, ids, wts, eps=1e-6,
                    norm_topk=True, prof=prof)

    def triton_step(w):
        gemv.gemv(res, w["wr"], logits, pro=gemv.PRO_RMSNORM, norm_w=w["ln"], eps=1e-6, xn_out=xn, block_n=4,
                  block_k=1024, num_warps=8)
        moe.moe_experts(xn, res, logits, w["gu"], w["sgu"], w["dn"], w["sdn"], act, ids, wts, top_k=K, block_n=16,
                        block_k=256, down_block_n=2, down_block_k=512, route=True)

    out = {"bytes_per_layer": nbytes}
    variants = [("cuda", cuda_step), ("triton", triton_step), ("cuda_again", cuda_step)]
    variants += [(f"cuda_{v[len('NEXRT_MOE_'):].lower()}", lambda w, k=kerns[v]: cuda_step(w, kern=k)) for v in kerns if v]
    for name, step in variants:
        res.copy_(res0)
        sec = _time_graph(lambda: [step(W[i % n_weights]) for i in range(layers)], reps=20) / layers
        out[name] = {"us_per_layer": sec * 1e6, "GBps": nbytes / sec / 1e9}
        log(f"moe block {name}: {sec * 1e6:.2f} us/layer, {nbytes / sec / 1e9:.0f} GB/s")
    names = ["init", "xn", "router", "shared_gu", "barrier1", "routing", "routed_gu", "barrier2", "down_ready", "end"]
    for v, k in kerns.items():
        prof = torch.zeros(k.plan.grid, 10, dtype=torch.int64, device=dev)
        for i in range(5):
            prof.zero_()
            cuda_step(W[i % n_weights], prof, kern=k)
            torch.cuda.synchronize()
        p = prof.double()
        t0 = p[:, 0].min()
        live = p[:, 9] > 0
        ph = {n: {"median": float((p[live, i] - t0).median() / 1e3), "max": float((p[live, i] - t0).max() / 1e3)}
              for i, n in enumerate(names)}
        out[f"phases_us{'_' + v if v else ''}"] = ph
        log(f"moe phases {v or 'cuda'} (us from first CTA start, median/max over CTAs): " +
            ", ".join(f"{n} {x['median']:.2f}/{x['max']:.2f}" for n, x in ph.items()))
    del W
    torch.cuda.empty_cache()
    return out


def moe_ncu_target() -> None:
    """Three plain launches of the CUDA MoE block at the 35B-A3B shape (a target for `ncu -k moe_decode_kernel`)."""
    from nexrt_vllm.engine import cuda_kernels as ck

    H, E, K, I, Is = MOE_35B
    dev, bf = torch.device("cuda"), torch.bfloat16
    w = _moe_weights()
    res, kern = torch.randn(H, device=dev).to(bf), ck.MoeDecode(dev, H, E, K, I, Is)
    bufs = (torch.zeros(E + 1, dtype=bf, device=dev), torch.zeros((K + 1) * I, dtype=bf, device=dev),
            torch.zeros(K, dtype=torch.int32, device=dev), torch.zeros(K, dtype=torch.float32, device=dev))
    for _ in range(3):
        kern.launch(res, w["ln"], w["wr"], w["gu"], w["dn"], w["sgu"], w["sdn"], *bufs, eps=1e-6, norm_topk=True)
    torch.cuda.synchronize()


def _time_graph(launch, reps: int = 5) -> float:
    launch()
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        launch()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        gr.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return statistics.median(ts)


SMALL_N = [(2, 512, 4), (4, 512, 4), (2, 1024, 4), (4, 1024, 4), (4, 1024, 8), (8, 1024, 8)]
WIDE_N = [(4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4)]


def gemv_sweep() -> list:
    """Bandwidth of the GEMV kernel per launch shape on the real projection shapes (weights rotated
    over enough copies to defeat L2), and of the MoE kernels on the 35B-A3B expert shapes."""
    from nexrt_vllm.engine.kernels import gemv as g
    from nexrt_vllm.engine.kernels import moe

    gated = [(8, 1024, 8), (4, 2048, 8), (8, 2048, 8), (16, 1024, 8), (4, 1024, 8)]
    shapes = [("gated out+res 2048x4096", 2048, 4096, g.PRO_GATED, g.EPI_RESIDUAL, gated),
              ("gated out+res 2048x2048", 2048, 2048, g.PRO_GATED, g.EPI_RESIDUAL, gated)]
    rows = []
    for name, n, k, pro, epi, configs in shapes:
        copies = max(1, int(512e6 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        z = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        nw_ = torch.zeros(k, device="cuda", dtype=torch.bfloat16)
        y = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
        best = None
        for bn, bk, nwarps in configs:
            def launch():
                for w in ws:
                    g.gemv(x, w, y, pro=pro, epi=epi, norm_w=nw_, z=z, group=128, block_n=bn, block_k=bk,
                           num_warps=nwarps)
            per = _time_graph(launch) / copies
            gbps = n * k * 2 / per / 1e9
            rows.append({"shape": name, "block_n": bn, "block_k": bk, "warps": nwarps, "us": per * 1e6, "GBps": gbps})
            if best is None or gbps > best[0]:
                best = (gbps, bn, bk, nwarps, per * 1e6)
        log(f"sweep {name}: best {best[0]:.0f} GB/s at block_n={best[1]} block_k={best[2]} warps={best[3]} "
            f"({best[4]:.1f} us)")
        del ws
        torch.cuda.empty_cache()
    # MoE (35B-A3B): 256 experts, top-8, I=512, H=2048, shared 512; 8 layers of weights rotated.
    E, K, H, I = 256, 8, 2048, 512
    nl = 8
    lay = [dict(gu=torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02,
                dn=torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02,
                sgu=torch.randn(2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02,
                sdn=torch.randn(H, I, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(nl)]
    res = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    nw_ = torch.zeros(H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(E + 1, device="cuda", dtype=torch.bfloat16)
    act = torch.zeros((K + 1) * I, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(E, device="cuda")[:K].sort().values.to(torch.int32)
    wts = torch.rand(K, device="cuda")
    nbytes = (K + 1) * 3 * H * I * 2
    combos = [(16, 256, 2, 512), (16, 512, 2, 512), (32, 256, 2, 512), (16, 256, 2, 256), (8, 256, 2, 512),
              (16, 256, 1, 512)]
    for bn, bk, dbn, dbk in combos:
        def launch():
            for L in lay:
                moe.moe_experts(res, res, logits, L["gu"], L["sgu"], L["dn"], L["sdn"], act, ids, wts, top_k=K,
                                block_n=bn, block_k=bk, down_block_n=dbn, down_block_k=dbk)
        per = _time_graph(launch) / nl
        rows.append({"shape": "moe_experts 35B", "block_n": bn, "block_k": bk, "down_block_n": dbn,
                     "down_block_k": dbk, "us": per * 1e6, "GBps": nbytes / per / 1e9})
        log(f"sweep moe gate_up ({bn},{bk}) down ({dbn},{dbk}): {per * 1e6:.1f} us, {nbytes / per / 1e9:.0f} GB/s")
    del lay
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--kernel-tests-only", action="store_true", help="of the tests, only the kernel tests")
    ap.add_argument("--tiny-steps", type=int, default=256)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--trained-parity", action="store_true", help="fused vs eager on trained tiny checkpoints")
    ap.add_argument("--checkpoints", default="", help="dir of <arch>/ checkpoints trained beforehand "
                    "(make_checkpoint(train='periodic')) for --trained-parity")
    ap.add_argument("--arches", default=",".join(TINY_ARCHS), help="families for --trained-parity")
    ap.add_argument("--sampling", action="store_true")
    ap.add_argument("--moe-profile", action="store_true", help="35B MoE block alone: CUDA vs Triton, phases")
    ap.add_argument("--moe-ncu-target", action="store_true", help="only: 3 launches of the CUDA MoE block (for ncu)")
    ap.add_argument("--bench-args", default="")
    ap.add_argument("--ab", default="", help="shapes (e.g. 35b,2b) for tuning_ab() at --ab-ctx, before the bench")
    ap.add_argument("--ab-ctx", default="8192", help="with --ab: context lengths, e.g. 8192,131072")
    ap.add_argument("--timeline", action="store_true", help="with --ab: a CUPTI kernel trace of every variant")
    ap.add_argument("--ab-variants", default=DEFAULT_AB, help="label:field=value,...;label2:... (Tuning fields)")
    args = ap.parse_args()
    if args.moe_ncu_target:
        moe_ncu_target()
        return 0
    os.makedirs(args.out, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save():  # after every section: a run cut short by the device's time limit keeps what it did
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=1)

    if args.trained_parity:  # first: the longest and the one a cut-short run must not lose
        for arch in filter(None, args.arches.split(",")):
            report.setdefault("trained_parity", {})[arch] = trained_parity(args.tiny_steps, arch, args.checkpoints)
            save()
    if not args.skip_tests:
        report["kernel_tests"] = kernel_tests(args.out)
        report["kernel_tests_pdl"] = kernel_tests(args.out, pdl=True)
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
    if args.sweep:
        report["gemv_sweep"] = gemv_sweep()
    if args.sampling:
        report["sampling"] = sampling_check()
    if args.moe_profile:
        report["moe_profile"] = moe_profile()
    save()
    for shape in filter(None, args.ab.split(",")):
        for ctx in (int(c) for c in args.ab_ctx.split(",")):
            key = shape if ctx == 8192 else f"{shape}@{ctx}"
            report.setdefault("tuning_ab", {})[key] = tuning_ab(shape, parse_variants(args.ab_variants), ctx=ctx,
                                                                timeline=args.timeline)
            save()
    rc = 0
    if args.bench_args:
        sys.path.insert(0, HERE)
        import decode_bench
        rc = decode_bench.main(shlex.split(args.bench_args))
    return rc


if __name__ == "__main__":
    sys.exit(main())
