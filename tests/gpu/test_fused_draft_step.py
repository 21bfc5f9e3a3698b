"""The MTP head's chained step as one persistent launch (`Tuning.draft_fused`, kernels/draft_step.py) against the
13 launches it replaces, on CPU through the Triton interpreter (each phase a launch of its own there, programs
taking several items round-robin; the grid barrier and the L2 requests are the GPU's: benchmarks/checks/
gpu_check.py --speculative): the round's tokens equal the one-token loop's, and every byte the head leaves (its
K/V rows, the drafts, the lm_head's logits and partials, the normed row the next step reads) equals the separate
launches', with the head as stored and with the head in fp8 drafting through a token map."""
import dataclasses

import pytest
import torch

from nexrt_vllm.engine import Engine, SamplingParams, kernels
from nexrt_vllm.engine.fp8 import FP8Weight
from nexrt_vllm.engine.gpu.decoder import FusedDecoder
from nexrt_vllm.engine.gpu.runner import GraphRunner
from nexrt_vllm.engine.gpu.spec_round import SpecRunner
from nexrt_vllm.engine.gpu.tuning import Tuning
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, periodic_prompt

kernels.load(interpret=True)

torch.set_num_threads(1)
K = 3
# few, large programs (the interpreter's cost is per program); 32-row GEMV tiles so that a phase has more
# tiles than the fused launch has programs
TUNING = Tuning(gemv=((1 << 62, 32, 128, 4),), gemv_rows=((1 << 62, 64, 128, 4, 2),), gemv_gated=(64, 128, 4),
                gemv_gated_rows=(64, 128, 4, 0), gemv_router=(64, 128, 4), prefetch=0, lm=(128, 256, 4),
                lm_rows=(128, 128, 4, 2), attn_splits=2, round_attn_splits=4, attn_block=32, gdn_block_v=64,
                gemv_fp8=((1 << 62, 32, 128, 4),), gemv_rows_fp8=((1 << 62, 64, 128, 4, 2),),
                gemv_gated_fp8=(64, 128, 4), lm_fp8=(128, 128, 4))


def _run(eng, prompt, first, sp, tuning, draft_vocab):
    eng.graph = GraphRunner(FusedDecoder(eng.model, eng.state, mode="fused", tuning=tuning))
    eng.spec_graph = runner = SpecRunner(eng.graph, eng.speculative, draft_vocab)
    eng.prefill(prompt)
    eng.speculative.rounds = [0] * (K + 2)
    tokens = list(eng.stream(first, sp))
    d = runner.d
    left = {n: t.clone() for n, t in (("k", d.drafter.k), ("v", d.drafter.v), ("drafts", d.tokens), ("g", d.g1),
                                      ("logits", d.dlogits), ("pmax", d.dpmax), ("pidx", d.dpidx))}
    return runner, tokens, list(eng.speculative.rounds), left


@pytest.mark.parametrize("draft_weights", ["checkpoint", "fp8"])
def test_fused_chain_step_equals_its_launches(ckpt_factory, draft_weights):
    path = ckpt_factory("qwen3_5", "bfloat16", **TRAINED_MTP["qwen3_5"])
    plain = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=80, progress=False)
    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=80, progress=False)
    eng.enable_speculative("mtp", K, draft_weights=draft_weights)
    V = eng.config.vocab_size
    draft_vocab = V // 2 if draft_weights == "checkpoint" else torch.randperm(
        V, generator=torch.Generator().manual_seed(5))
    prompt, sp = periodic_prompt(40, seed=15), SamplingParams(max_tokens=7, ignore_eos=True)
    first = int(plain.prefill(prompt).argmax())
    want = list(plain.stream(first, sp))
    _, tokens, rounds, left = _run(eng, prompt, first, sp, TUNING, draft_vocab)
    assert tokens == want
    # twice the launches' rows per GEMV tile (Tuning.draft_fused_rows): a row's sums do not depend on its tile
    fused_tuning = dataclasses.replace(TUNING, draft_fused=True, draft_fused_rows=64)
    fused, f_tokens, f_rounds, f_left = _run(eng, prompt, first, sp, fused_tuning, draft_vocab)
    plan = [s.group for s in fused.d.plan()]
    assert plan.count("chain_step") == K - 1 and not any(g.startswith("chain_") and g not in ("chain_step",
                                                                                             "chain_pick")
                                                         for g in plan), plan
    assert isinstance(fused.d.head.mixer.w_qkv, FP8Weight) == (draft_weights == "fp8")
    assert f_tokens == want and f_rounds == rounds
    for name, t in left.items():
        assert torch.equal(f_left[name], t), name
    assert fused.d.bar.tolist() == [0, 0]  # at rest: the interpreter's launches never reach a barrier
    assert sum(k * c for k, c in enumerate(rounds)) > sum(rounds), rounds  # drafts were accepted


def test_fused_pass_tail_drafts_from_the_accepted_row(ckpt_factory):
    """`Tuning.draft_fused_pass`: the head's pass over the verified rows runs its attention over all M rows (their
    K/V rows, byte for byte the launches'), then only the accepted row from the o_proj on, in the persistent
    launch's last phases (the head as stored here, so the same weights as the M-row launches): the round's tokens
    stay the target's and its drafts are accepted as often as with the M-row launches."""
    path = ckpt_factory("qwen3_5", "bfloat16", **TRAINED_MTP["qwen3_5"])
    plain = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=80, progress=False)
    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=80, progress=False)
    eng.enable_speculative("mtp", K)
    prompt, sp = periodic_prompt(40, seed=15), SamplingParams(max_tokens=7, ignore_eos=True)
    first = int(plain.prefill(prompt).argmax())
    want = list(plain.stream(first, sp))
    _, _, rounds, left = _run(eng, prompt, first, sp, dataclasses.replace(TUNING, draft_fused=True), None)
    fused, tokens, f_rounds, f_left = _run(
        eng, prompt, first, sp, dataclasses.replace(TUNING, draft_fused=True, draft_fused_pass=True), None)
    plan = [s.group for s in fused.d.plan()]
    assert plan.count("draft_tail") == 1 and not any(g in plan for g in ("draft_select", "draft_attn_o_proj",
                                                                       "draft_mlp_down", "draft_lm_head+argmax"))
    assert tokens == want and f_rounds == rounds, (f_rounds, rounds)
    assert torch.equal(f_left["k"], left["k"]) and torch.equal(f_left["v"], left["v"])
