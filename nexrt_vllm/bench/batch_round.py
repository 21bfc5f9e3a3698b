"""The captured batched MTP round at a real shape (`benchmarks/decode_bench.py --batch 1,2,4,8 --speculative mtp`):
round time for B requests speculating together, against the one-request round and the plain batch step
at the same B, all in one process over one copy of the fused weights.

Batch 1 is the one-request round (gpu/spec_round.py: what a `--max-batch 1 --speculative mtp` node
runs) and its plain step; batch B > 1 is the batched round over B slots (gpu/batch_round.py, one
graph, every slot live, each at the same context) and the plain batch step (gpu/batch_decoder.py).
Random weights and a random head: timing only (the tokens and acceptance of the batched round are
checked on trained checkpoints, tests/gpu/test_batch_graph.py). Per-request tok/s at an acceptance
length L = L / round time (InferenceX's golden 3.39 for 3 drafts); total = B times that.

With `slots` N (`--batch-slots`), every batch size B (1 too) is the bucket a node of N slots replays with
B requests live: the graph over its first B slots of an N-slot decoder, whose launch choices follow the
bucket's rows (or N's with Tuning.batch_invariant); the rows' "step_ms" is then the one-request step.
"""
from __future__ import annotations

import time

import torch

from nexrt_vllm.bench import spec_round
from nexrt_vllm.bench.batch_step import fill_slots
from nexrt_vllm.bench import step as S
from nexrt_vllm.bench.shapes import NAMES, SHAPES

GOLDEN = {3: 3.39, 4: 3.97}  # InferenceX's pinned acceptance length by drafts per round (Qwen3.5 MTP)


def _groups(rd, k: int | None = None, reps: int = 20) -> dict:
    """Device time of each launch group of the batched round over slots 0..k-1 (default: all; its launches
    back to back in one graph)."""
    times = S.group_times(rd.plan(k), lambda: rd.b.k_common.launch_options(rd.b.pdl),
                          (rd.pos, rd.tok, rd.step, rd.round, rd.acc, rd.base), reps)
    return {name: {"launches": n, "us_per_round": sec * 1e6} for name, (n, sec) in times.items()}


def build(eng, layers, tuning, B: int, max_len: int, num_spec: int, draft_vocab, gen: torch.Generator,
          slots: int = 0):
    """The plain batch step and the batched round over B slots (every slot live, random tokens) sharing
    `layers` (a FusedDecoder's weights) under `tuning`: (states, batch decoder, round decoder, step graph,
    round graph). `slots` N >= B: the decoders hold N slots and the graphs are their bucket of the first B
    (no step graph for B = 1: a batch step has 2 slots or more)."""
    from nexrt_vllm.engine.gpu.batch_decoder import BatchDecoder
    from nexrt_vllm.engine.gpu.batch_round import BatchRoundDecoder
    from nexrt_vllm.engine.gpu.runner import capture_graph
    from nexrt_vllm.engine.state import StackedStates

    M, n = num_spec + 1, max(slots, B)
    states = StackedStates(eng.model.config, n, max_len, eng.dtype, eng.device, pad_rows=M)
    bd = BatchDecoder(eng.model, states, tuning, layers=layers)
    rd = BatchRoundDecoder(bd, eng.speculative.drafter.w.rows, num_spec, draft_vocab)
    bd.live.zero_()
    g_step = capture_graph(lambda: bd.launch(B), (bd.step, bd.tok, bd.pos), (bd.ring, bd.ring_host)) \
        if B >= 2 else None
    g_round = capture_graph(lambda: rd.launch(B), (rd.step, rd.round, rd.tok, rd.pos), ())
    bd.live[:B].fill_(1)
    rd.row_live[:B * M].fill_(1)
    rd.tok.copy_(torch.randint(3, bd.cfg.vocab_size, (n, M), generator=gen, device=gen.device))
    bd.tok.copy_(rd.tok[:, 0])
    return states, bd, rd, g_step, g_round


def run_batch_round_shape(key: str, contexts: list[int], batches: list[int], steps: int, tuning=None,
                          num_spec: int = 3, draft_vocab=None, breakdown_ctx: int = 8192, slots: int = 0,
                          dtype: str = "bf16", draft_weights: str = "checkpoint") -> dict:
    t0 = time.time()
    M = num_spec + 1
    max_len = max(contexts, default=0) + (steps + 8) * M + 64
    eng = spec_round.spec_engine(key, max_len, num_spec, draft_vocab, dtype, draft_weights)
    tg = spec_round.tag(key, dtype, draft_weights)
    fused, runner1, spec1 = spec_round.capture(eng, tuning, draft_vocab)
    g1 = runner1.capture(False)
    S.log(f"[{tg}/batch-round] one-request step and round captured in {time.time() - t0:.1f}s")
    L = GOLDEN.get(num_spec)
    res = {"shape": NAMES[key], "config": SHAPES[key], "weights": "random", "dtype": dtype,
           "draft_weights": draft_weights, "pdl": fused.pdl,
           "batches": batches, "num_speculative_tokens": num_spec, "acceptance_length": L,
           "draft_vocab": spec1.d.draft_vocab, "slots": slots or None, "rows": []}
    gen = torch.Generator(device=eng.device).manual_seed(1234)
    base: dict[int, float] = {}

    def row(B, ctx, t_round, t_step):
        r = {"batch": B, "context": ctx, "round_ms": t_round * 1e3, "step_ms": t_step * 1e3,
             "round_over_step": t_round / t_step}
        if ctx in base:
            r["round_over_b1_round"] = t_round / base[ctx]
        if L:
            r["tok_s_per_request_at_acceptance"] = L / t_round
            r["tok_s_total_at_acceptance"] = B * L / t_round
        return r

    one_step: dict[int, float] = {}
    if 1 in batches or slots:
        for ctx in contexts:
            S.fill_context(eng, ctx, gen)
            t_step, t_round = spec_round.time_step_and_round(eng, fused, g1, spec1, ctx, steps)
            base[ctx], one_step[ctx] = t_round, t_step
            res["rows"].append(dict(row(1, ctx, t_round, t_step), one_request=True))
            S.log(f"[{tg}/batch-round] B 1 ctx {ctx}: round {t_round * 1e3:.3f} ms = {t_round / t_step:.2f}x step")
    for B in [b for b in batches if b > 1 or slots]:
        t1 = time.time()
        states, bd, rd, g_step, g_round = build(eng, fused.layers, tuning, B, max_len, num_spec, draft_vocab, gen,
                                                slots)
        S.log(f"[{tg}/batch-round] B {B}: captured in {time.time() - t1:.1f}s, {len(rd.plan())} launches, GPU mem "
              f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB")
        for ctx in contexts:
            fill_slots(states, ctx, gen)
            t_step = S.time_from(g_step, bd.pos, ctx, steps) if g_step is not None else one_step[ctx]
            t_round = S.time_from(g_round, rd.pos, ctx, steps)
            r = row(B, ctx, t_round, t_step)
            if ctx == breakdown_ctx:
                rd.pos.fill_(ctx)
                r["groups"] = _groups(rd, B)
                rd.pos.fill_(ctx)
                r["marginals"] = S.group_marginals(rd.plan(B), lambda: rd.b.k_common.launch_options(rd.b.pdl),
                                                   (rd.pos, rd.tok, rd.step, rd.round, rd.acc, rd.base))
            res["rows"].append(r)
            S.log(f"[{tg}/batch-round] B {B} ctx {ctx}: round {t_round * 1e3:.3f} ms = {r['round_over_step']:.2f}x "
                  f"its step" + (f", {r['round_over_b1_round']:.2f}x the B 1 round" if ctx in base else "")
                  + (f", at acceptance {L}: {r['tok_s_per_request_at_acceptance']:.0f} tok/s/request, "
                     f"{r['tok_s_total_at_acceptance']:.0f} tok/s" if L else ""))
        bd.live.zero_()
        del g_step, g_round, rd, bd, states
        torch.cuda.empty_cache()
    del spec1, runner1, fused, eng, g1
    torch.cuda.empty_cache()
    return res


def measure(eng, layers, tuning, ctx: int, B: int, num_spec: int = 3, draft_vocab=None, reps: int = 100) -> dict:
    """The batched round and the plain batch step over B slots under `tuning` at context ctx (a launch-shape
    sweep's candidate, benchmarks/tools/tuning_sweep.py --batch): median times and the round's groups."""
    gen = torch.Generator(device=eng.device).manual_seed(1234)
    states, bd, rd, g_step, g_round = build(eng, layers, tuning, B, ctx + (reps + 8) * (num_spec + 1) + 64, num_spec,
                                            draft_vocab, gen)
    fill_slots(states, ctx, gen)
    t_step = S.time_from(g_step, bd.pos, ctx, reps)
    t_round = S.time_from(g_round, rd.pos, ctx, reps)
    rd.pos.fill_(ctx)
    groups = {k: v["us_per_round"] for k, v in _groups(rd).items()}
    del g_step, g_round, rd, bd, states
    torch.cuda.empty_cache()
    return {"step_us": t_step * 1e6, "round_us": t_round * 1e6, "round_over_step": t_round / t_step,
            "groups": groups}
