"""The captured batch step at a real shape (`benchmarks/decode_bench.py --batch 1,2,4,8`): step time, per-request
and total tok/s and bytes per step for B requests decoding together, against the one-request step.

Batch 1 is the one-request step (FusedDecoder, its own graph: what a `--max-batch 1` node runs);
batch B > 1 is the batch step over B slots (gpu/batch_decoder.py, one graph, every slot live, each
slot at the same context). Both share one copy of the fused weights. Bytes per step count what the
step must move once: every weight once (the M-row GEMVs read each for all rows), per live slot its
K/V rows 0..n, its GDN state read and written, its conv state, its embedding row; the MoE experts:
the distinct experts the B rows select, measured per layer on this run's tokens (an expert two
rows choose is read once: their programs read its tiles together). A row "live 1" is the largest B's
runner with one slot live: the smallest bucket graph it replays then (gpu/batch_runner.py; `graph_slots`),
what a request alone costs on such a node. With `parity_steps`, each
slot's greedy tokens in the batch against the same request alone on the eager engine and on the
one-request graph (checked on grafted, trained weights; reported on random ones).
"""
from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch

from nexrt_vllm.bench import step as S
from nexrt_vllm.bench.shapes import NAMES, SHAPES

# acceptance of the issue this measures: batch step over the one-request step at 8K, per shape and batch
TARGETS = {"2b": {4: 1.25, 8: 1.6}, "35b": {4: 1.8}}


def distinct_experts(bd) -> dict[int, int]:
    """Run one batch step launch by launch; after each MoE experts launch, the distinct experts its live
    rows chose (by layer)."""
    out = {}
    live = bd.live.bool()
    with bd.k_common.launch_options(bd.pdl):
        for s in bd.plan():
            s.run()
            if s.group == "moe_experts":
                torch.cuda.synchronize()
                out[s.layer] = int(bd.ids[live].unique().numel())
    return out


def batch_bytes(bd, n: int, live: int, distinct: dict[int, int]) -> dict[str, int]:
    """Bytes one batch step must move at context n with `live` slots live (module doc), per launch group."""
    from nexrt_vllm.engine.gpu.fusion import MoEFFN

    c, nb, B = bd.cfg, S.nbytes, bd.n
    kv_row = c.num_kv_heads * c.head_dim * bd.embed.element_size()
    E, k = c.num_experts, c.num_experts_per_tok
    out: dict[str, int] = {}
    for s in bd.plan():
        L = bd.layers[s.layer] if s.layer is not None else None
        mx, ff = (L.mixer, L.ffn) if L is not None else (None, None)
        b = {
            "embed": lambda: live * c.hidden_size * bd.embed.element_size(),
            "gdn_in_proj+conv": lambda: nb(mx.w_in) + nb(mx.conv_w) + 2 * live * nb(mx.state.conv) // B,
            "gdn_step": lambda: 2 * live * nb(mx.state.rec) // B,
            "gdn_out_proj": lambda: nb(mx.w_out),
            # the split norm (Tuning.gated_norm_rows) re-reads the GDN output rows, activations as the
            # fused prologue's: not counted, as no launch's activation rows are
            "gdn_out_norm": lambda: 0,
            "attn_qkv_proj": lambda: nb(mx.w_qkv),
            "attn_qknorm_rope_kvwrite": lambda: 2 * live * kv_row,
            "attn_splitk+combine": lambda: 2 * live * kv_row * (n + 1),
            "attn_o_proj": lambda: nb(mx.w_o),
            "moe_router": lambda: nb(ff.w_router),
            "moe_experts": lambda: (S.experts_nbytes(ff.gate_up, distinct.get(s.layer, k), E)
                                    + S.experts_nbytes(ff.down, distinct.get(s.layer, k), E)
                                    + nb(ff.s_gate_up) + nb(ff.s_down)) if isinstance(ff, MoEFFN) else 0,
            "mlp_gate_up+swiglu": lambda: nb(ff.w_gate_up),
            "mlp_down": lambda: nb(ff.w_down),
            "lm_head+argmax": lambda: nb(bd.lm_head),
            "finish": lambda: 0,
        }[s.group]()
        out[s.group] = out.get(s.group, 0) + b
    out["total"] = sum(out.values())
    return out


def batch_groups(bd, reps: int = 20) -> dict:
    """Device time of each launch group of the batch step (every launch of the group back to back in one
    graph, as step.kernel_groups does for the one-request step)."""
    times = S.group_times(bd.plan(), lambda: bd.k_common.launch_options(bd.pdl), (bd.pos, bd.tok, bd.step), reps)
    return {name: {"launches": n, "us_per_step": sec * 1e6} for name, (n, sec) in times.items()}


def fill_slots(states, ctx: int, gen: torch.Generator) -> None:
    """Every slot holds `ctx` tokens of plausible magnitude (timing only)."""
    for st in states.states:
        S.fill_context(SimpleNamespace(state=st), ctx, gen)


def _time_batch(bd, graph, ctx: int, live: int, reps: int, gen: torch.Generator) -> float:
    """Median device time (s) of the batch step graph with slots 0..live-1 live at position ctx."""
    bd.live.zero_()
    bd.live[:live].fill_(1)
    bd.tok.copy_(torch.randint(3, bd.cfg.vocab_size, (bd.n,), generator=gen, device=gen.device))
    return S.time_from(graph, bd.pos, ctx, reps)


def parity(eng, fused_runner, runner, prompts: list[list[int]], steps: int) -> dict:
    """Each slot's greedy tokens in the batch (all slots joined at once) against the same request alone on
    the eager engine and on the one-request graph."""
    from nexrt_vllm.engine.sampling import SamplingParams

    sp = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    alone, graph_alone, firsts = [], [], []
    st0 = eng.state
    for p in prompts:
        first = int(eng.prefill(p).argmax())
        n0, snap = eng.export_state()
        firsts.append(first)
        alone.append(list(eng.stream(first, sp)))
        eng.import_state(n0, snap)
        graph_alone.append(list(fused_runner.generate(first, steps)))
    slots = runner.d.states.states
    for b, p in enumerate(prompts):  # the slot's state: the prompt's prefill, as a hand-off would leave it
        eng.state = slots[b]
        eng.prefill(p)
    eng.state = st0
    for b, first in enumerate(firsts):
        assert runner.join(b, first, sp) is None
    got = {b: [] for b in range(len(prompts))}
    while runner.busy:
        for ev in runner.step():
            got[ev.slot].append(ev.token)
    rows = []
    for b in range(len(prompts)):
        div = next((i for i, (x, y) in enumerate(zip(got[b], alone[b])) if x != y), None)
        rows.append({"slot": b, "equals_eager_alone": got[b] == alone[b], "equals_graph_alone": got[b] == graph_alone[b],
                     "graph_alone_equals_eager": graph_alone[b] == alone[b], "first_divergence_vs_eager": div,
                     "tokens_head": got[b][:16]})
    return {"steps": steps, "slots": rows, "all_equal_eager": all(r["equals_eager_alone"] for r in rows),
            "all_equal_graph_alone": all(r["equals_graph_alone"] for r in rows)}


def run_batch_shape(key: str, contexts: list[int], batches: list[int], steps: int, bw: float, tuning=None,
                    graft_dir: str = "", parity_steps: int = 0, breakdown_ctx: int = 8192, dtype: str = "bf16") -> dict:
    from nexrt_vllm.engine.gpu.batch_decoder import BatchDecoder
    from nexrt_vllm.engine.gpu.batch_runner import BatchRunner, bucket
    from nexrt_vllm.engine.gpu.decoder import FusedDecoder
    from nexrt_vllm.engine.gpu.runner import GraphRunner
    from nexrt_vllm.engine.state import StackedStates

    t0 = time.time()
    max_len = max(contexts, default=0) + max(steps, parity_steps) + 64
    seg = None
    if graft_dir:
        eng, tcfg = S.graft_engine(key, graft_dir, max_len, dtype=dtype)
        vocab = tcfg.vocab_size
    else:
        eng = S.random_engine(key, max_len, dtype)
        vocab = eng.config.vocab_size
    fused = FusedDecoder(eng.model, eng.state, mode="fused", tuning=tuning)
    runner1 = GraphRunner(fused)
    g1 = runner1.capture(False)
    S.log(f"[{key}/batch] one-request step captured in {time.time() - t0:.1f}s")
    res = {"shape": NAMES[key], "config": SHAPES[key], "weights": "graft" if graft_dir else "random", "dtype": dtype,
           "pdl": fused.pdl, "batches": batches, "targets_step_ratio_at_8k": TARGETS.get(key, {}), "rows": []}
    gen = torch.Generator(device=eng.device).manual_seed(1234)
    base: dict[int, float] = {}
    if 1 in batches:
        for ctx in contexts:
            S.fill_context(eng, ctx, gen)
            nb = S.bytes_per_step(fused, ctx)["total"]
            fused.tok.fill_(1)
            t = S.time_from(g1, fused.state.position, ctx, steps)
            base[ctx] = t
            res["rows"].append(_row(1, 1, ctx, t, nb, bw, t))
            S.log(f"[{key}/batch] B 1 ctx {ctx}: step {t * 1e3:.3f} ms, {1 / t:.0f} tok/s")
    for B in [b for b in batches if b > 1]:
        t1 = time.time()
        states = StackedStates(eng.model.config, B, max_len, eng.dtype, eng.device)
        bd = BatchDecoder(eng.model, states, tuning, layers=fused.layers)
        runner = BatchRunner(bd)
        runner.capture()
        S.log(f"[{key}/batch] B {B}: captured in {time.time() - t1:.1f}s, {len(bd.plan())} launches, GPU mem "
              f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB")
        if parity_steps:
            prompts = [S.periodic_prompt(vocab, seed=7 + b)[0] for b in range(B)]
            p = parity(eng, runner1, runner, prompts, parity_steps)
            res.setdefault("parity", {})[str(B)] = p
            S.log(f"[{key}/batch] B {B} parity over {parity_steps} steps: batch == eager alone {p['all_equal_eager']}, "
                  f"== one-request graph {p['all_equal_graph_alone']}")
        lives = [B] + ([1] if B == max(batches) else [])
        for ctx in contexts:
            fill_slots(states, ctx, gen)
            for live in lives:
                bd.live.zero_()
                bd.live[:live].fill_(1)
                bd.pos.fill_(ctx)
                distinct = distinct_experts(bd) if eng.config.num_experts else {}
                nb = batch_bytes(bd, ctx, live, distinct)
                k = bucket(runner.buckets, live)
                t = _time_batch(bd, runner.graphs[k], ctx, live, steps, gen)
                row = _row(B, live, ctx, t, nb["total"], bw, base.get(ctx))
                row["graph_slots"] = k
                row["bytes_breakdown"] = nb
                if distinct:
                    row["distinct_experts_per_layer"] = statistics.mean(distinct.values())
                if ctx == breakdown_ctx and live == B:
                    bd.pos.fill_(ctx)
                    row["groups"] = batch_groups(bd)
                res["rows"].append(row)
                S.log(f"[{key}/batch] B {B} live {live} ctx {ctx}: step {t * 1e3:.3f} ms"
                      + (f" = {row['step_over_b1']:.3f}x B 1" if "step_over_b1" in row else "")
                      + f", {row['tok_s_total']:.0f} tok/s total, {nb['total'] / 1e9:.3f} GB/step, "
                      f"MBU {100 * row['mbu']:.1f}%")
        runner.d.live.zero_()
        del runner, bd, states
        torch.cuda.empty_cache()
    del runner1, fused, eng, g1
    torch.cuda.empty_cache()
    return res


def _row(batch: int, live: int, ctx: int, t: float, nbytes: int, bw: float, t1: float | None) -> dict:
    row = {"batch": batch, "live": live, "context": ctx, "step_ms": t * 1e3, "tok_s_per_request": 1 / t,
           "tok_s_total": live / t, "bytes_per_step": nbytes, "mbu": nbytes / t / bw}
    if t1:
        row["step_over_b1"] = t / t1
    return row
