"""The captured speculative round (engine/gpu/spec_round.py: M-row verify, accept, commit, the MTP head's
drafts, all fused Triton launches) against the eager engine, on CPU through the Triton interpreter:
greedy tokens equal the one-token loop's token for token on trained tiny checkpoints (with a trained
MTP head) of the MoE family (Qwen3-Next) and the dense one (Qwen3.5); with the drafter's full prompt context every round accepts what the
eager speculative loop accepts (the same histogram of tokens per round), also with the head
drafting through a draft token map that holds every id in a scrambled order; after a hand-off
without that context, with the head drafting from half the vocabulary or from a token map that
lacks the continuation's tokens (no round accepts a draft), and across a stop id the tokens stay
exact; the committed K/V rows equal the plain loop's; on an FP8 checkpoint (weights kept e4m3 + block scales) the
round's tokens equal the dequantized engine's one-token loop, and a bf16 checkpoint drafting with its head in fp8
(`draft_weights="fp8"`) gives the target's tokens with the eager fp8 head's acceptance. The graph capture and the pipelined replays are
GPU-only (benchmarks/checks/gpu_check.py --speculative); here each replay runs the round's launches in order.
The interpreter takes ~10-20 s per round, hence the short streams (the H200 run checks 256 tokens)."""
import dataclasses

import pytest
import torch

from nexrt_vllm.engine import Engine, SamplingParams, kernels
from nexrt_vllm.engine.fp8 import PUBLISHED_NOT_CONVERT, FP8Weight
from nexrt_vllm.engine.gpu.decoder import FusedDecoder
from nexrt_vllm.engine.gpu.runner import GraphRunner
from nexrt_vllm.engine.gpu.tuning import Tuning
from nexrt_vllm.engine.gpu.spec_round import SpecRunner
from nexrt_vllm.testing import make_fp8_checkpoint
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, periodic_prompt

kernels.load(interpret=True)

torch.set_num_threads(1)
K = 3  # drafts per round: M = 4
# Few, large programs: the interpreter's cost is per program, not per element.
# The verify's GEMVs on the tensor-core kernel (2 stages), its GDN out_proj on the fold kernel, as on the H200.
CPU_TUNING = Tuning(gemv=((1 << 62, 64, 128, 4),), gemv_rows=((1 << 62, 64, 128, 4, 2),), gemv_gated=(64, 128, 4),
                    gemv_gated_rows=(64, 128, 4, 0), gemv_router=(64, 128, 4), prefetch=0, lm=(128, 256, 4),
                    lm_rows=(128, 128, 4, 2), attn_splits=2, round_attn_splits=0, attn_block=32, gdn_block_v=64,
                    moe=(64, 128, 1), moe_down=(64, 64, 1))
FP8_TUNING = dataclasses.replace(
    CPU_TUNING, gemv_fp8=((1 << 62, 64, 128, 4),), gemv_rows_fp8=((1 << 62, 64, 128, 4, 2),),
    gemv_gated_fp8=(64, 128, 4), lm_fp8=(128, 128, 4), moe_fp8=(64, 128, 4), moe_down_fp8=(64, 64, 4))


def engines(ckpt_factory, arch):
    """(the plain eager engine, a speculative engine on the graph path as `use_graph` builds it on CUDA)."""
    path = ckpt_factory(arch, "bfloat16", **TRAINED_MTP[arch])
    plain = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=80, progress=False)
    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=80, progress=False)
    eng.enable_speculative("mtp", K)
    return plain, eng


def on_graph_path(eng: Engine, draft_vocab=None, tuning: Tuning = CPU_TUNING) -> SpecRunner:
    eng.graph = GraphRunner(FusedDecoder(eng.model, eng.state, mode="fused", tuning=tuning))
    eng.spec_graph = SpecRunner(eng.graph, eng.speculative, draft_vocab)
    return eng.spec_graph


@pytest.mark.parametrize("arch", ["qwen3_next"])  # MoE + shared expert, GDN, attention (the H200 run: all three)
def test_round_equals_eager_with_the_full_context(ckpt_factory, arch):
    plain, eng = engines(ckpt_factory, arch)
    prompt, n = periodic_prompt(40, seed=11), 6
    sp = SamplingParams(max_tokens=n + 1, ignore_eos=True)
    first = int(plain.prefill(prompt).argmax())
    want = list(plain.stream(first, sp))
    _, want_state = plain.export_state()
    eng.prefill(prompt)  # the eager speculative loop, the head with the prompt's context
    eng.speculative.rounds = [0] * (K + 2)
    assert list(eng.stream(first, sp)) == want
    eager_rounds = eng.speculative.rounds
    runner = on_graph_path(eng)
    eng.prefill(prompt)
    eng.speculative.rounds = [0] * (K + 2)
    assert list(eng.stream(first, sp)) == want and eng.finish_reason == "length"
    assert eng.speculative.rounds == eager_rounds and sum(k * c for k, c in enumerate(eager_rounds)) > 1.5 * sum(
        eager_rounds), eager_rounds
    assert runner.rounds_run >= sum(eager_rounds)
    # the K/V rows of every emitted position equal the plain loop's (summation order apart)
    end = len(prompt) + n
    assert eng.state.seq_len >= end
    eng.state.set_seq_len(end)
    _, st = eng.export_state()
    for name, ref in want_state.items():
        if name.endswith((".k", ".v")):
            err = float((st[name].double() - ref.double()).norm() / ref.double().norm())
            assert err < 2e-2, (name, err)


def test_handoff_draft_vocab_and_stop(ckpt_factory):
    plain, eng = engines(ckpt_factory, "qwen3_5")
    prompt = periodic_prompt(40, seed=12)
    first = int(plain.prefill(prompt).argmax())
    want = list(plain.stream(first, SamplingParams(max_tokens=7, ignore_eos=True)))
    # after a hand-off: no head context, placeholder drafts first; the head reads half the vocabulary
    on_graph_path(eng, draft_vocab=eng.config.vocab_size // 2)
    eng.prefill(prompt)
    eng.import_state(*eng.export_state())
    assert list(eng.stream(first, SamplingParams(max_tokens=5, ignore_eos=True))) == want[:4]
    # a stop id inside an accepted round: the tokens after it are dropped
    on_graph_path(eng)
    stop = want[2]
    eng.prefill(prompt)
    got = list(eng.stream(first, SamplingParams(max_tokens=20, stop_token_ids=(stop,))))
    assert got == want[:want.index(stop) + 1] and eng.finish_reason == "stop"


def test_verify_gemvs_ask_l2_for_the_next_weight(ckpt_factory):
    """Tuning.rows_l2_prefetch: each verify GEMV asks L2 for the first bytes of the next verify GEMV's weight
    (both halves of a SwiGLU weight), the verify's last (the lm_head) and every other launch (the head's too)
    for nothing, no launch with 0; the round's tokens are the same with it."""
    plain, eng = engines(ckpt_factory, "qwen3_5")
    prompt = periodic_prompt(40, seed=13)
    first = int(plain.prefill(prompt).argmax())
    sp = SamplingParams(max_tokens=7, ignore_eos=True)
    want = list(plain.stream(first, sp))
    off = dataclasses.replace(CPU_TUNING, rows_l2_prefetch=0)
    assert not any(hasattr(s.run, "keywords") for s in on_graph_path(eng, tuning=off).d.plan())
    assert any(hasattr(s.run, "keywords") for s in on_graph_path(eng).d.plan())  # on by default
    nbytes = 4096
    d = on_graph_path(eng, tuning=dataclasses.replace(CPU_TUNING, rows_l2_prefetch=nbytes)).d
    plan, layers = d.plan(), d.f.layers
    weights = {"gdn_in_proj+conv": lambda L: L.mixer.w_in, "gdn_out_proj": lambda L: L.mixer.w_out,
               "attn_qkv_proj": lambda L: L.mixer.w_qkv, "attn_o_proj": lambda L: L.mixer.w_o,
               "mlp_gate_up+swiglu": lambda L: L.ffn.w_gate_up, "mlp_down": lambda L: L.ffn.w_down,
               "lm_head+argmax": lambda L: d.f.lm_head}
    gemvs = [s for s in plan if s.group.startswith("verify_") and s.group[7:] in weights]
    assert len(gemvs) == 4 * len(layers) + 1
    for s, nxt in zip(gemvs, gemvs[1:]):
        flat, off1, each, segs = s.run.keywords["l2"]
        w = weights[nxt.group[7:]](layers[nxt.layer] if nxt.layer is not None else None)
        halves = nxt.group == "verify_mlp_gate_up+swiglu"
        assert flat.data_ptr() == w.data_ptr() and flat.numel() == w.numel() * w.element_size()
        assert (segs, off1, each) == (2 if halves else 1, flat.numel() // 2 if halves else 0,
                                      nbytes // (2 if halves else 1)), s.group
    assert sum(hasattr(s.run, "keywords") for s in plan) == len(gemvs) - 1
    eng.prefill(prompt)
    assert list(eng.stream(first, sp)) == want


def test_draft_token_map(ckpt_factory):
    """The head drafting from a token map: its lm_head reads the map's rows (a gathered copy), the
    pick maps the argmax index back to the token id."""
    plain, eng = engines(ckpt_factory, "qwen3_5")
    V = eng.config.vocab_size
    prompt, sp = periodic_prompt(40, seed=15), SamplingParams(max_tokens=13, ignore_eos=True)
    first = int(plain.prefill(prompt).argmax())
    want = list(plain.stream(first, sp))  # the first round's drafts are the eager head's, the others the map's
    eng.prefill(prompt)  # the eager speculative loop: the full-vocabulary rounds
    eng.speculative.rounds = [0] * (K + 2)
    assert list(eng.stream(first, sp)) == want
    full_rounds = eng.speculative.rounds
    g = torch.Generator().manual_seed(5)
    # every id in a scrambled order: the whole vocabulary's drafts, so its rounds; a scrambled half
    # that holds the periodic text's tokens (all the trained head drafts here): the same
    perm = torch.randperm(V, generator=g)
    used = sorted(set(prompt) | set(want) | {first})
    rest = [t for t in perm.tolist() if t not in used][:V // 2 - len(used)]
    half = torch.tensor(used + rest)[torch.randperm(V // 2, generator=g)]
    for ids in (perm, half):
        runner = on_graph_path(eng, draft_vocab=ids)
        assert runner.d.draft_vocab == len(ids) and runner.d.draft_lm.shape[0] == len(ids)
        eng.prefill(prompt)
        eng.speculative.rounds = [0] * (K + 2)
        assert list(eng.stream(first, sp)) == want
        assert eng.speculative.rounds == full_rounds, (len(ids), eng.speculative.rounds, full_rounds)
    assert full_rounds[K + 1] >= 2, full_rounds  # a round drafted through the map accepted every draft
    # a map without the continuation's tokens, after a hand-off (no head context: placeholder drafts
    # first, not counted): no draft can be right, every round emits one token, still the right one
    on_graph_path(eng, draft_vocab=[t for t in perm.tolist() if t not in set(want)])
    eng.prefill(prompt)
    eng.import_state(*eng.export_state())
    eng.speculative.rounds = [0] * (K + 2)
    assert list(eng.stream(first, SamplingParams(max_tokens=5, ignore_eos=True))) == want[:4]
    assert eng.speculative.rounds == [0, 3, 0, 0, 0], eng.speculative.rounds


def test_four_drafts(ckpt_factory):
    """M = 5 verify positions (4 drafts, InferenceX's other golden draft count): the round graph's tokens
    equal the one-token loop's and its rounds the eager speculative loop's. The GDN out_proj's norm in a
    launch of its own (`Tuning.gated_norm_rows` <= M), the batch decoders' path for many rows; the verify's
    GEMVs with K split over two programs (`RowsShape.splits`: the K = 256 ones; K = 128 is one block); the GDN
    verify keeping a state per position for the commit to pick (`Tuning.gdn_recommit` off; the other tests run
    the default, the commit running the accepted tokens again); the round's attention in other K/V splits
    than the step's (`Tuning.round_attn_splits`)."""
    path = ckpt_factory("qwen3_5", "bfloat16", **TRAINED_MTP["qwen3_5"])
    plain = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=80, progress=False)
    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=80, progress=False)
    eng.enable_speculative("mtp", 4)
    prompt, sp = periodic_prompt(30, seed=16), SamplingParams(max_tokens=11, ignore_eos=True)
    first = int(plain.prefill(prompt).argmax())
    want = list(plain.stream(first, sp))
    eng.prefill(prompt)
    assert list(eng.stream(first, sp)) == want
    eager_rounds, eng.speculative.rounds = eng.speculative.rounds, [0] * 6
    runner = on_graph_path(eng, tuning=dataclasses.replace(CPU_TUNING, gated_norm_rows=5, gdn_recommit=False,
                                                           gemv_rows=((1 << 62, 64, 128, 4, 2, 2),),
                                                           round_attn_splits=4))
    assert runner.M == 5 and not runner.d.recommit and runner.d.commit_all is None
    assert runner.d.attn_scratch["m_buf"].numel() == 5 * eng.model.config.num_heads * 4  # the round's 4 splits
    gdn_layers = len(eng.model.config.gdn_layers)
    plan = [s.group for s in runner.d.plan()]
    assert plan.count("verify_gdn_out_norm") == plan.count("verify_gdn_out_proj") == gdn_layers  # norm, then GEMV
    eng.prefill(prompt)
    assert list(eng.stream(first, sp)) == want
    assert eng.speculative.rounds == eager_rounds and max(k for k, c in enumerate(eager_rounds) if c) >= 3, eager_rounds


def test_fp8_checkpoint(ckpt_factory, tmp_path):
    """The trained Qwen3-Next with its MTP head quantized as the published FP8 releases are (128 x 128 blocks; head,
    router, shared-expert gate and the GDN's b / a in bf16): the round over the kept fp8 weights (the verify's M-row
    GEMVs on the tensor-core kernel and the fold kernel, fp8 experts, the MTP head's fp8 layer) gives the tokens of
    the eager one-token loop on the dequantized checkpoint, and its drafts are accepted."""
    path = make_fp8_checkpoint(ckpt_factory("qwen3_next", "bfloat16", **TRAINED_MTP["qwen3_next"]),
                               str(tmp_path / "fp8"), block=128, not_convert=PUBLISHED_NOT_CONVERT)
    deq = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=80, progress=False,
                                 fp8_weights="dequantize")
    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=80, progress=False,
                                 fp8_weights="keep")
    eng.enable_speculative("mtp", K)
    prompt, sp = periodic_prompt(40, seed=11), SamplingParams(max_tokens=7, ignore_eos=True)
    first = int(deq.prefill(prompt).argmax())
    want = list(deq.stream(first, sp))
    runner = on_graph_path(eng, tuning=FP8_TUNING)
    L = runner.d.f.layers
    attn, head = next(x.mixer for x in L if hasattr(x.mixer, "w_qkv")), runner.d.head
    assert all(isinstance(w, FP8Weight) for w in (L[0].mixer.w_in, L[0].mixer.w_out, L[0].ffn.gate_up, attn.w_qkv,
                                                  head.mixer.w_qkv, head.ffn.gate_up, head.ffn.down))
    assert int(eng.prefill(prompt).argmax()) == first
    eng.speculative.rounds = [0] * (K + 2)
    assert list(eng.stream(first, sp)) == want
    rounds = eng.speculative.rounds
    assert sum(k * c for k, c in enumerate(rounds)) > 1.5 * sum(rounds), rounds


def test_fp8_draft_head(ckpt_factory):
    """A bf16 checkpoint drafting with its MTP head in fp8 (draft_weights="fp8"): the chained steps read the head's
    fp8 projections, every draft the token map's rows of the fp8 lm_head copy, the pass over the verified rows the
    head as stored; the target's weights bf16. The round gives the target's tokens and accepts what the eager loop
    with the same head accepts."""
    plain, eng = engines(ckpt_factory, "qwen3_5")
    eng.enable_speculative("mtp", K, draft_weights="fp8")
    V = eng.config.vocab_size
    prompt, sp = periodic_prompt(40, seed=15), SamplingParams(max_tokens=13, ignore_eos=True)
    first = int(plain.prefill(prompt).argmax())
    want = list(plain.stream(first, sp))
    eng.prefill(prompt)
    eng.speculative.rounds = [0] * (K + 2)
    assert list(eng.stream(first, sp)) == want  # the eager loop, fp8 head
    eager_rounds = eng.speculative.rounds
    runner = on_graph_path(eng, draft_vocab=torch.randperm(V, generator=torch.Generator().manual_seed(5)),
                           tuning=FP8_TUNING)
    d = runner.d
    assert isinstance(d.draft_lm, FP8Weight) and d.draft_lm.shape[0] == V
    # the chained single-row steps read the fp8 copy; the pass over the verified rows the head as stored
    assert all(isinstance(w, FP8Weight) for w in (d.head.mixer.w_qkv, d.head.mixer.w_o, d.head.ffn.w_gate_up,
                                                  d.head.ffn.w_down))
    assert not any(isinstance(w, FP8Weight) for w in (d.f.lm_head, d.f.layers[-1].ffn.w_gate_up,
                                                      d.head_rows.mixer.w_qkv, d.head_rows.ffn.w_down))
    eng.prefill(prompt)
    eng.speculative.rounds = [0] * (K + 2)
    assert list(eng.stream(first, sp)) == want
    assert eng.speculative.rounds == eager_rounds and eager_rounds[K + 1] >= 2, (eng.speculative.rounds, eager_rounds)
