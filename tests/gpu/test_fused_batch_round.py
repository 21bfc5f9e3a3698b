"""The batched speculative round (gpu/batch_round.py BatchRoundDecoder, BatchRoundRunner: B request slots'
MTP rounds in one plan of fused Triton launches, verify rows slot-major) against each request alone, on
CPU through the Triton interpreter.

Trained tiny checkpoints with trained MTP heads (confident greedy tokens, drafts that get accepted; one also
quantized as the published FP8 checkpoints and read e4m3): every slot's tokens equal the eager engine's
one-token loop for its request alone, token for token, while slots join late, leave early (max_tokens), meet a stop id or are cancelled; a request with the
head's prompt context drafts at once (its rounds accept what the eager speculative loop accepts),
one after a hand-off without it starts from placeholder drafts; a request that runs to its
context's last position speculates to the end (the accept clamps the round, its rows past the end
are not written) and ends "length" with the tokens alone gives; a slot that is not live is left
byte for byte as it was. The graph capture and pipelined replays on the device:
tests/gpu/test_batch_graph.py (gpu)."""
import dataclasses

import pytest
import torch

from nexrt_vllm.engine import Engine, EngineError, SamplingParams, kernels
from nexrt_vllm.engine.fp8 import PUBLISHED_NOT_CONVERT, FP8Weight
from nexrt_vllm.engine.gpu.batch_round import BatchRoundRunner
from nexrt_vllm.engine.gpu.tuning import Tuning
from nexrt_vllm.testing import make_fp8_checkpoint
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, periodic_prompt

kernels.load(interpret=True)

torch.set_num_threads(1)
K, MAX_LEN = 2, 48  # drafts per round (M = 3)
# Few, large programs: the interpreter's cost is per program. Every M-row GEMV on the tensor-core kernel
# (2 stages), as the batched round runs them past 8 rows.
CPU_TUNING = Tuning(gemv=((1 << 62, 64, 128, 4),), gemv_rows=((1 << 62, 64, 128, 4, 2),), gemv_gated=(64, 128, 4),
                    gemv_gated_rows=(64, 128, 4, 0), gemv_router=(64, 128, 4), prefetch=0, lm=(128, 256, 4),
                    lm_rows=(128, 128, 4, 2), attn_splits=2, attn_block=32, gdn_block_v=64, moe=(64, 128, 1),
                    moe_down=(64, 64, 1), gemv_rows_wide=(), gemv_fp8=((1 << 62, 64, 128, 4),),
                    gemv_rows_fp8=((1 << 62, 64, 128, 4, 2),), gemv_gated_fp8=(64, 128, 4), lm_fp8=(128, 128, 4),
                    moe_fp8=(64, 128, 4), moe_down_fp8=(64, 64, 4))


def alone(ref: Engine, prompt: list[int], n: int) -> tuple[int, list[int]]:
    """(first token, the eager one-token loop's next n greedy tokens) of a request alone."""
    first = int(ref.prefill(prompt).argmax())
    return first, list(ref.stream(first, SamplingParams(max_tokens=n + 1, ignore_eos=True)))


def batch_engine(path: str, slots: int, tuning: Tuning = CPU_TUNING, fp8_weights: str = "auto",
                 **kw) -> tuple[Engine, BatchRoundRunner, list[Engine]]:
    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=MAX_LEN, progress=False,
                                 fp8_weights=fp8_weights)
    eng.enable_speculative("mtp", K, **kw)
    runner = eng.batch_runner(slots, tuning)
    assert isinstance(runner, BatchRoundRunner)
    eng.use_batch(runner)
    return eng, runner, eng.slots(slots)


def run(runner, got: dict, ends: dict, n_steps: int | None = None) -> None:
    """`n_steps` batch rounds (None: until no slot is busy), collecting each slot's tokens and finish."""
    k = 0
    while (n_steps is None and runner.busy) or (n_steps is not None and k < n_steps):
        for ev in runner.step():
            got.setdefault(ev.slot, []).append(ev.token)
            if ev.finish_reason:
                ends[ev.slot] = ev.finish_reason
        k += 1
        assert k < 200


# knobs: the in_proj's conv epilogue over every slot's rows at once (Tuning.conv_all_slots), the RMSNorm
# GEMVs' norm in launches of their own (Tuning.norm_rows: the buckets of 2 and 3 slots, not one slot's 3 rows;
# qwen3_5's dense FFN, the head's pass too), the
# attention's K/V in other splits than the one-request round's (Tuning.batch_attn_splits) and the GEMVs' own
# shapes past 8 rows (Tuning.gemv_rows_wide: the round's 9 rows), there with K split over two programs
# (RowsShape.splits; the K = 128 GEMVs have one K block of 128: one split), the GDN commit that runs the
# accepted tokens again instead of the verify keeping a state per position (Tuning.gdn_recommit)
# fp8: the checkpoint quantized as the published FP8 releases, its weights (the MTP head's too) kept e4m3 + scales,
# against the eager engine on them (which dequantizes each weight as loading would); draft-fp8: a bf16 checkpoint
# whose MTP head drafts in fp8 (draft_weights="fp8"), which the batched round leaves to single-row passes
@pytest.mark.parametrize("arch,knobs,fmt", [("qwen3_5", False, "bf16"), ("qwen3_next", False, "bf16"),
                                            ("qwen3_5", True, "bf16"), ("qwen3_next", True, "fp8"),
                                            ("qwen3_5", False, "draft-fp8")])
def test_batched_round_equals_each_request_alone(ckpt_factory, tmp_path, arch, knobs, fmt):
    path = ckpt_factory(arch, "bfloat16", **TRAINED_MTP[arch])
    if fmt == "fp8":
        path = make_fp8_checkpoint(path, str(tmp_path / "fp8"), block=128, not_convert=PUBLISHED_NOT_CONVERT)
    keep = "keep" if fmt == "fp8" else "auto"
    ref = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=MAX_LEN, progress=False,
                                 fp8_weights=keep)
    prompts = [periodic_prompt(n, seed=s) for n, s in ((21, 31), (9, 32), (30, 33))]
    steps = [4, 9, MAX_LEN - 30 - 1]  # slot 2 runs to its context's end
    refs = [alone(ref, p, n) for p, n in zip(prompts, steps)]

    tuning = dataclasses.replace(CPU_TUNING, conv_all_slots=True, norm_rows=4, batch_attn_splits=4, gdn_recommit=True,
                                 gemv_rows_wide=((1 << 62, 32, 128, 4, 2, 2),)) if knobs else \
        dataclasses.replace(CPU_TUNING, conv_all_slots=False, batch_attn_splits=0, gdn_recommit=False)  # other sides
    eng, runner, engines = batch_engine(path, 3, tuning, keep, **(
        {"draft_weights": "fp8"} if fmt == "draft-fp8" else {}))
    d = runner.d
    if fmt == "fp8":
        assert all(isinstance(w, FP8Weight) for w in (d.b.layers[0].mixer.w_in, d.b.layers[0].ffn.gate_up,
                                                      d.head.mixer.w_qkv))
    if fmt == "draft-fp8":  # the slots' eager loops draft with the fp8 copy, the batched round with the head as stored
        assert isinstance(eng.speculative.drafter.w.layer.mixer.o_proj, FP8Weight)
        assert not any(isinstance(w, FP8Weight) for w in (d.head.mixer.w_qkv, d.head.ffn.w_down, d.draft_lm))
    assert [d._norm_once(k * d.M, k) for k in (1, 2, 3)] == [False, knobs, knobs]
    assert d.recommit == knobs and (d.rec_after is None) == knobs
    assert [s.group for s in d.plan()].count("verify_gdn_in_proj+conv") == len(d.cfg.gdn_layers) * (2 if knobs else 1)
    assert [e.state for e in engines] == d.states.states and all(e.batch_graph is runner for e in engines)
    assert all(e.speculative is s for e, s in zip(engines, runner.speculators))
    engines[0].prefill(prompts[0])  # the eager prefill: the slot's state and its head's prompt context
    engines[2].prefill(prompts[2])
    # slot 1 after a hand-off without the head's context: placeholder drafts first
    engines[1].prefill(prompts[1])
    engines[1].import_state(*engines[1].export_state())
    idle = [t.clone() for t in engines[1].state.buffers()] + [d.draft_k[1].clone()]
    got, ends = {}, {}
    for b in (0, 2):
        assert runner.join(b, refs[b][0], SamplingParams(max_tokens=steps[b] + 1, ignore_eos=True)) is None
    run(runner, got, ends, 2)
    after = [t.clone() for t in engines[1].state.buffers()] + [d.draft_k[1].clone()]
    assert all(torch.equal(x, y) for x, y in zip(idle, after)) and 1 not in got
    assert runner.join(1, refs[1][0], SamplingParams(max_tokens=steps[1] + 1, ignore_eos=True)) is None
    run(runner, got, ends)
    for b in range(3):
        assert got[b] == refs[b][1], (arch, b, got[b], refs[b][1])
        assert ends[b] == "length"
    assert engines[2].state.seq_len == MAX_LEN  # to the context's last position
    rounds = runner.speculators[0].rounds
    assert sum(k * c for k, c in enumerate(rounds)) > 1.3 * sum(rounds), rounds  # the head's drafts were accepted
    assert runner.busy == [] and runner.step() == []


def test_stop_cancel_and_refusals(ckpt_factory):
    """A stop id inside an accepted round ends that request with it (the round's later tokens dropped); a
    request cancelled mid-stream (`leave`) and its rounds in flight leave the other's tokens as they
    are alone, and its slot takes the next request with exact tokens; sampled / logprob requests are
    refused by the round graph. The replays cover the fewest slots holding every live one (buckets), each
    with its own launch choices (here the two-slot bucket's 6 rows normalize in launches of their own, the
    one-slot bucket's 3 rows in the GEMVs' prologue), and a request's tokens stay exact across them."""
    arch = "qwen3_5"
    path = ckpt_factory(arch, "bfloat16", **TRAINED_MTP[arch])
    ref = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=MAX_LEN, progress=False)
    pa, pb = periodic_prompt(17, seed=41), periodic_prompt(12, seed=42)
    fa, want_a = alone(ref, pa, 12)
    fb, want_b = alone(ref, pb, 12)
    eng, runner, (a, b) = batch_engine(path, 2, dataclasses.replace(CPU_TUNING, norm_rows=4))
    assert not runner.d._norm_once(3, 1) and runner.d._norm_once(6, 2)
    a.prefill(pa)
    b.prefill(pb)
    with pytest.raises(EngineError, match="greedy"):
        runner.join(0, fa, SamplingParams(max_tokens=5, temperature=0.7, seed=1))
    with pytest.raises(EngineError, match="greedy"):
        runner.join(0, fa, SamplingParams(max_tokens=5, logprobs=2))
    assert runner.join(0, fa, SamplingParams(max_tokens=5, stop_token_ids=(fa,))) == "stop"
    stop = want_b[4]
    assert runner.join(0, fa, SamplingParams(max_tokens=50, ignore_eos=True)) is None
    assert runner.join(1, fb, SamplingParams(max_tokens=50, stop_token_ids=(stop,), ignore_eos=True)) is None
    got, ends = {}, {}
    while 1 in runner.busy:
        run(runner, got, ends, 1)
    assert got[1] == want_b[:want_b.index(stop) + 1] and ends[1] == "stop"
    run(runner, got, ends, 1)
    runner.leave(0)  # cancelled with a round in flight
    assert got[0] == want_a[:len(got[0])] and runner.busy == []
    # the cancelled slot's next request (the same prompt again) decodes exactly
    a.prefill(pa)
    assert list(runner.generate(0, fa, SamplingParams(max_tokens=13, ignore_eos=True))) == want_a
    # slot 0 alone replayed the one-slot bucket (M rows), both slots the two-slot one
    assert runner.buckets == [1, 2] and runner.bucket_replays[1] > 0 and runner.bucket_replays[2] > 0


@pytest.mark.parametrize("invariant", [False, True])
def test_each_bucket_makes_its_own_launch_choices(ckpt_factory, invariant):
    """The launch choices follow the replay's rows (one slot: the one-request round's), or with
    `Tuning.batch_invariant` the node's capacity in every bucket: here the RMSNorm of the M-row GEMVs in
    launches of their own (`Tuning.norm_rows` 6: the two-slot bucket's 6 rows), seen in the plan as two
    launches of the group where the prologue makes one."""
    path = ckpt_factory("qwen3_5", "bfloat16", **TRAINED_MTP["qwen3_5"])
    _, runner, _ = batch_engine(path, 2, dataclasses.replace(CPU_TUNING, norm_rows=6, batch_invariant=invariant))
    d = runner.d
    layers = len(d.cfg.attention_layers)

    def launches(k: int, group: str) -> int:
        return [s.group for s in d.plan(k)].count(group)

    assert launches(2, "verify_attn_qkv_proj") == 2 * layers and launches(2, "draft_attn_qkv_proj") == 2
    want = 2 if invariant else 1  # one slot's 3 rows: the prologue, unless the choices follow the capacity
    assert launches(1, "verify_attn_qkv_proj") == want * layers and launches(1, "draft_attn_qkv_proj") == want
    assert launches(1, "verify_lm_head+argmax") == want
