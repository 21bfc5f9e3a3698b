"""The captured MTP round at a real shape (`benchmarks/decode_bench.py --speculative mtp`): round time against the
plain step in the same process, bytes per round, effective tok/s at given acceptance lengths, and
greedy parity of the round graph against the plain step graph and the eager engine.

Bytes per round count what the round must move once: every weight of the verify (the MoE experts:
the distinct experts the M rows select, measured per layer on this run's tokens), K/V rows 0..n+M-1
read and M rows written, each GDN layer's state read once and written after each of the M positions
(with Tuning.gdn_recommit: not written), the commit (one state read and written), the head's M-row pass
and chained steps (its fc, layer,
experts and the lm_head rows it reads: `draft_vocab`). An expert two rows choose is counted once
(the experts launch runs all rows at once, their programs reading such an expert's tiles together:
the bytes are what the round needs, its time what the kernels take). Effective tok/s = acceptance length / round
time: computed from the measured round time, not measured with a trained head (the random and
grafted heads here draft badly; the measured acceptance is reported beside it).
"""
from __future__ import annotations

import statistics
import time

import torch

from nexrt_vllm.bench import step as S
from nexrt_vllm.bench.shapes import NAMES, SHAPES

ACCEPT = (2.0, 2.5, 3.0, 3.5)


def random_mtp_head(eng, seed: int = 5, dtype: str = "bf16") -> None:
    """Give the engine's model a random MTP head of its shape (bf16; matrices N(0, 0.02), norms N(0, 0.1));
    `dtype` "fp8": its projections quantized as the target's (an FP8 checkpoint's head, kept by the loader)."""
    from nexrt_vllm.engine.spec.mtp import expected_mtp_shapes

    g = torch.Generator(device="cpu").manual_seed(seed)
    heads = {}
    for n, shape in expected_mtp_shapes(eng.config).items():
        std = 0.02 if len(shape) > 1 else 0.1
        heads["mtp." + n] = (torch.randn(shape, generator=g) * std).to(eng.dtype).to(eng.device)
    if dtype == "fp8":
        heads = S.fp8_weights(heads, eng.config)
    eng.model.mtp = heads


def _distinct_experts(sd) -> dict[int, int]:
    """Run one round launch by launch; after a verify layer's MoE experts launch (all rows), the distinct
    experts its rows chose, by layer index (the head's experts run for one row)."""
    out = {}
    with sd.f.launch_options():
        for s in sd.plan():
            s.run()
            if s.group == "verify_moe_experts":
                torch.cuda.synchronize()
                out[s.layer] = int(sd.ids[:sd.M].unique().numel())
    return out


def round_bytes(sd, n: int, distinct: dict) -> dict[str, int]:
    """Bytes one round must move at context n (module doc), per launch group and in total."""
    c, M, nb = sd.cfg, sd.M, S.nbytes
    kv_row = c.num_kv_heads * c.head_dim * sd.f.embed.element_size()
    E, k = c.num_experts, c.num_experts_per_tok

    def experts(ff, n_e):
        return S.experts_nbytes(ff.gate_up, n_e, E) + S.experts_nbytes(ff.down, n_e, E) + nb(ff.s_gate_up) + nb(ff.s_down)

    def layer_bytes(group, L, rows, ctx, n_e):
        mx, ff = L.mixer, L.ffn
        return {
            "gdn_in_proj+conv": lambda: nb(mx.w_in) + nb(mx.conv_w) + nb(mx.state.conv) * (2 + rows),
            # the live state read, and the state after each position written (none with Tuning.gdn_recommit)
            "gdn_step": lambda: (1 + (0 if sd.recommit else rows)) * nb(mx.state.rec),
            "gdn_out_proj": lambda: nb(mx.w_out),
            "gdn_out_norm": lambda: 0,  # activation rows (batch_step.batch_bytes)
            "attn_qkv_proj": lambda: nb(mx.w_qkv),
            "attn_qknorm_rope_kvwrite": lambda: 2 * rows * kv_row,
            "attn_splitk+combine": lambda: 2 * kv_row * (ctx + rows),
            "attn_o_proj": lambda: nb(mx.w_o),
            "moe_router": lambda: nb(ff.w_router),
            "moe_experts": lambda: experts(ff, n_e),
            "mlp_gate_up+swiglu": lambda: nb(ff.w_gate_up),
            "mlp_down": lambda: nb(ff.w_down),
        }[group]()

    def head_bytes(group, rows):  # one MTP head launch group over `rows` rows (its FFN: one row)
        if group == "fc":
            return nb(sd.drafter.w.fc)
        if group == "lm_head+argmax":
            return nb(sd.draft_lm) * sd.draft_vocab // sd.draft_lm.shape[0]  # the rows it reads (any format)
        if group in ("input", "select", "pick", "pick+input"):
            return 0
        if group.startswith(("mlp_", "moe_")):
            return layer_bytes(group, sd.head, 1, n, k)
        return layer_bytes(group, sd.head_rows if rows > 1 else sd.head, rows, n, 0)

    out: dict[str, int] = {}
    for s in sd.plan():
        stage, _, group = s.group.partition("_")
        if stage == "verify":
            if group == "embed":
                b = M * c.hidden_size * sd.f.embed.element_size()
            elif group == "lm_head+argmax":
                b = nb(sd.f.lm_head)
            else:
                b = layer_bytes(group, sd.f.layers[s.layer], M, n, distinct.get(s.layer, k))
        elif s.group == "commit":  # one layer's, or every GDN layer's in one launch (Tuning.gdn_recommit)
            b = sum(2 * (nb(sd.f.state.gdn(i).rec) + nb(sd.f.state.gdn(i).conv))
                    for i in (c.gdn_layers if s.layer is None else [s.layer]))
        elif stage in ("draft", "chain"):
            b = head_bytes(group, M if stage == "draft" else 1)
        else:  # accept: the partials
            b = 0
        out[s.group] = out.get(s.group, 0) + b
    out["total"] = sum(out.values())
    return out


def round_groups(sd, nb: dict, reps: int = 20) -> dict:
    """Device time of each launch group of the round (every launch of the group back to back in one
    graph, as step.kernel_groups does for the step), with the bytes `round_bytes` counts for it."""
    times = S.group_times(sd.plan(), sd.f.launch_options, [sd.f.state.position, sd.f.step, sd.tokens, sd.round], reps)
    return {name: {"launches": n, "us_per_round": sec * 1e6, "bytes_per_round": nb.get(name, 0),
                   "GBps": nb.get(name, 0) / sec / 1e9} for name, (n, sec) in times.items()}


def round_marginals(sd, reps: int = 30) -> dict:
    """What each launch group costs inside the round graph (`step.group_marginals`)."""
    return S.group_marginals(sd.plan(), sd.f.launch_options, [sd.f.state.position, sd.f.step, sd.tokens, sd.round],
                             reps)


def capture(eng, tuning, draft_vocab):
    """The fused step graph and the round graph of a speculating engine under `tuning`: (fused, runner, spec)."""
    from nexrt_vllm.engine.gpu.decoder import FusedDecoder
    from nexrt_vllm.engine.gpu.runner import GraphRunner
    from nexrt_vllm.engine.gpu.spec_round import SpecRunner

    fused = FusedDecoder(eng.model, eng.state, mode="fused", tuning=tuning)
    runner = GraphRunner(fused)
    runner.capture()
    spec = SpecRunner(runner, eng.speculative, draft_vocab)
    spec.capture()
    return fused, runner, spec


def time_step_and_round(eng, fused, g_plain, spec, ctx: int, reps: int) -> tuple[float, float]:
    """Median device time (s) of the plain step graph and of the round graph, each from position ctx."""
    fused.tok.fill_(1)
    t_step = S.time_from(g_plain, fused.state.position, ctx, reps)
    spec.d.tokens.fill_(1)
    return t_step, S.time_from(spec.graph, eng.state.position, ctx, reps)


def spec_engine(key: str, max_len: int, num_spec: int = 3, draft_vocab=None, dtype: str = "bf16",
                draft_weights: str = "checkpoint"):
    """A random-weight engine of shape `key` with a random MTP head (`dtype` "fp8": both quantized as the published
    FP8 checkpoints), speculating with the head in `draft_weights` (spec/mtp.py DRAFT_WEIGHTS)."""
    eng = S.random_engine(key, max_len, dtype)
    random_mtp_head(eng, dtype=dtype)
    eng.enable_speculative("mtp", num_spec, draft_vocab, draft_weights=draft_weights)
    return eng


def tag(key: str, dtype: str, draft_weights: str) -> str:
    """A log / check tag: the shape, then the weight format unless bf16, the draft weights unless the checkpoint's."""
    return "/".join([key] + ([dtype] if dtype != "bf16" else []) +
                    ([f"draft-{draft_weights}"] if draft_weights != "checkpoint" else []))


def measure_round(eng, tuning, ctx: int, draft_vocab=None, reps: int = 100) -> dict:
    """The captured round (and the plain step) under `tuning` at context ctx: median times and the
    round's launch groups (`round_groups`, bytes counted as `round_bytes`)."""
    fused, runner, spec = capture(eng, tuning, draft_vocab)
    sd = spec.d
    eng.state.position.fill_(ctx)
    nb = round_bytes(sd, ctx, _distinct_experts(sd))
    g = runner.capture(False)
    t_step, t_round = time_step_and_round(eng, fused, g, spec, ctx, reps)
    eng.state.position.fill_(ctx)
    groups = round_groups(sd, nb)
    del spec, runner, fused, g
    return {"step_us": t_step * 1e6, "round_us": t_round * 1e6, "round_over_step": t_round / t_step,
            "groups": {k: v["us_per_round"] for k, v in groups.items()}}


def run_spec_shape(key: str, contexts: list[int], steps: int, parity_steps: int, bw: float, tuning=None,
                   graft_dir: str = "", num_spec: int = 3, draft_vocab=None,
                   breakdown_ctx: int = 8192, dtype: str = "bf16", draft_weights: str = "checkpoint") -> dict:
    from nexrt_vllm.engine.sampling import SamplingParams

    t0 = time.time()
    M = num_spec + 1
    max_len = max(contexts, default=0) + (steps + 8) * M + max(parity_steps, 64) + 64
    prompt = seg = None
    if graft_dir:
        eng, tcfg = S.graft_engine(key, graft_dir, max_len, dtype=dtype)
        prompt, seg = S.periodic_prompt(tcfg.vocab_size)
        random_mtp_head(eng, dtype=dtype)
        eng.enable_speculative("mtp", num_spec, draft_vocab, draft_weights=draft_weights)
    else:
        eng = spec_engine(key, max_len, num_spec, draft_vocab, dtype, draft_weights)
    fused, runner, spec = capture(eng, tuning, draft_vocab)
    tag_ = tag(key, dtype, draft_weights)
    sd = spec.d
    S.log(f"[{tag_}/mtp] built + captured in {time.time() - t0:.1f}s; GPU mem "
           f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB; {len(sd.plan())} launches per round")
    res = {"shape": NAMES[key], "config": SHAPES[key], "weights": "graft" if graft_dir else "random", "dtype": dtype,
           "draft_weights": draft_weights, "num_speculative_tokens": num_spec, "verify_width": M,
           "draft_vocab": sd.draft_vocab,
           "draft_vocab_kind": "first" if sd.draft_ids is None else "map",
           "launches_per_round": len(sd.plan()), "launches_per_step": len(fused.plan()), "contexts": []}
    gen = torch.Generator(device="cuda").manual_seed(1234)
    if parity_steps:
        if prompt is None:
            prompt = torch.randint(3, eng.config.vocab_size, (40,), generator=gen, device="cuda").tolist()
        first = int(eng.prefill(prompt).argmax())
        plain = [first] + list(runner.generate(first, parity_steps))
        eng.graph, eng.spec_graph = runner, spec
        eng.speculative.rounds = [0] * (M + 1)
        eng.prefill(prompt)  # the head sees the prompt: full context
        got = [first] + list(eng.stream(first, SamplingParams(max_tokens=parity_steps + 1, ignore_eos=True)))
        rounds = list(eng.speculative.rounds)
        eng.graph = eng.spec_graph = None
        # the oracle: the eager one-token loop
        eng.speculative, spec_saved = None, eng.speculative
        eng.prefill(prompt)
        eager = [first] + list(eng.stream(first, SamplingParams(max_tokens=parity_steps + 1, ignore_eos=True)))
        eng.speculative = spec_saved
        div = next((i for i, (a, b) in enumerate(zip(got, eager)) if a != b), None)
        res["parity"] = {"steps": parity_steps, "round_graph_equals_eager": got == eager,
                         "plain_graph_equals_eager": plain == eager, "first_divergence_vs_eager": div,
                         "rounds": rounds, "acceptance_length": sum(i * r for i, r in enumerate(rounds)) / max(1, sum(rounds)),
                         "tokens_head": got[:24]}
        if seg:
            res["parity"]["continues_period"] = got[:21] == [seg[(len(prompt) + i) % len(seg)] for i in range(21)]
        S.log(f"[{tag_}/mtp] parity: round graph == eager {got == eager} (plain graph == eager {plain == eager}, "
               f"first divergence {div}), acceptance length {res['parity']['acceptance_length']:.2f} over "
               f"{sum(rounds)} rounds")
    g_plain = runner.capture(False)
    for ctx in contexts:
        S.fill_context(eng, ctx, gen)
        eng.state.position.fill_(ctx)
        distinct = _distinct_experts(sd)
        nb_round = round_bytes(sd, ctx, distinct)
        nb_step = S.bytes_per_step(fused, ctx)
        t_step, t_round = time_step_and_round(eng, fused, g_plain, spec, ctx, steps)
        row = {"context": ctx, "steps": steps, "step_ms": t_step * 1e3, "round_ms": t_round * 1e3,
               "round_over_step": t_round / t_step, "bytes_per_step": nb_step["total"],
               "bytes_per_round": nb_round["total"], "bytes_round_breakdown": nb_round,
               "distinct_experts_per_layer": statistics.mean(distinct.values()) if distinct else None,
               "mbu_step": nb_step["total"] / t_step / bw, "mbu_round": nb_round["total"] / t_round / bw,
               "copy_bw_Bps": bw, "tok_s_plain": 1 / t_step,
               "effective_tok_s_computed": {str(a): a / t_round for a in ACCEPT},
               "speedup_vs_plain_computed": {str(a): a * t_step / t_round for a in ACCEPT}}
        if ctx == breakdown_ctx:
            eng.state.position.fill_(ctx)
            row["round_groups"] = round_groups(sd, nb_round)
            eng.state.position.fill_(ctx)
            marg = row["round_marginals"] = round_marginals(sd)
            for name, v in sorted(row["round_groups"].items(), key=lambda kv: -kv[1]["us_per_round"])[:14]:
                S.log(f"[{tag_}/mtp]   {name:<34}{v['launches']:>4} launches {v['us_per_round']:>9.1f} us "
                       f"(in the graph {marg['groups_us'][name]:>7.1f}) {v['bytes_per_round'] / 1e6:>9.1f} MB "
                       f"{v['GBps']:>7.0f} GB/s")
        res["contexts"].append(row)
        S.log(f"[{tag_}/mtp] ctx {ctx}: step {t_step * 1e3:.3f} ms (MBU {100 * row['mbu_step']:.1f}%), round "
               f"{t_round * 1e3:.3f} ms = {row['round_over_step']:.3f}x (MBU {100 * row['mbu_round']:.1f}%, "
               f"{nb_round['total'] / 1e9:.2f} GB), at acceptance 2.0/2.5/3.0/3.5: "
               + "/".join(f"{a / t_round:.0f}" for a in ACCEPT) + " tok/s (computed)")
    del spec, runner, fused, eng
    torch.cuda.empty_cache()
    return res
