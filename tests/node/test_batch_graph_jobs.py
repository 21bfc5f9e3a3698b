"""The decode thread (node/batch.py DecodeBatch) over the batch step (engine/gpu/batch_runner.py), on CPU
through the Triton interpreter: the node's wiring of `nexrt-decode --graph fused --max-batch B`.

Greedy requests without logprobs are stepped by the batch step, the others (seeded sampling,
logprobs) by their slot engine's eager loop in the same batch steps; a request whose first token
stops ends at once, a cancelled one leaves mid-stream. Each request's tokens (and finish reason)
equal the same request alone on the eager engine; every slot is released. With speculative decoding
the greedy ones run the batched round graph instead. The captured graphs on a GPU:
tests/gpu/test_batch_graph.py."""

import torch

from nexrt_vllm.engine import Engine, SamplingParams, kernels
from nexrt_vllm.engine.gpu.batch_decoder import BatchDecoder
from nexrt_vllm.engine.gpu.batch_runner import BatchRunner
from nexrt_vllm.engine.gpu.tuning import Tuning
from nexrt_vllm.engine.state import StackedStates
from nexrt_vllm.node.batch import DecodeBatch
from nexrt_vllm.testing.batch_clients import JobRequest
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, periodic_prompt

kernels.load(interpret=True)
torch.set_num_threads(1)
SLOTS, MAX_LEN = 3, 64
CPU_TUNING = Tuning(gemv=((1 << 62, 64, 128, 4),), gemv_rows=((1 << 62, 64, 128, 4, 2),), prefetch=0,
                    lm=(128, 256, 4), lm_rows=(128, 128, 4, 2), attn_splits=2, round_attn_splits=0, attn_block=32,
                    gdn_block_v=64, moe=(64, 128, 1), moe_down=(64, 64, 1))


def test_greedy_jobs_on_the_batch_step_the_others_eager(ckpt_factory):
    path = ckpt_factory("qwen3_5", "bfloat16", **TRAINED_MTP["qwen3_5"])
    ref = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=MAX_LEN, progress=False)
    reqs = [JobRequest("greedy", 0, periodic_prompt(19, seed=51), SamplingParams(max_tokens=6, ignore_eos=True)),
            JobRequest("sampled", 1, periodic_prompt(11, seed=52),
                    SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, seed=7)),
            JobRequest("logprobs", 2, periodic_prompt(25, seed=53), SamplingParams(max_tokens=3, logprobs=2,
                                                                                ignore_eos=True))]
    later = [JobRequest("cancelled", 1, periodic_prompt(14, seed=54), SamplingParams(max_tokens=40, ignore_eos=True),
                     cancel_after=2)]
    first, want = {}, {}
    for r in reqs + later:
        first[r.rid] = int(ref.prefill(r.prompt).argmax())
        want[r.rid] = [(s.token, s.logprob) for s in ref.steps(first[r.rid], r.params)]
    # a greedy request whose first token stops: it ends before any step
    stopper = JobRequest("stops", 2, reqs[0].prompt, SamplingParams(max_tokens=5, stop_token_ids=(first["greedy"],)))

    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=MAX_LEN, progress=False)
    runner = BatchRunner(BatchDecoder(eng.model, StackedStates(eng.model.config, SLOTS, MAX_LEN, eng.dtype,
                                                               eng.device), CPU_TUNING))
    eng.use_batch(runner)
    batch = DecodeBatch(eng.slots(SLOTS))
    try:
        for r in reqs:
            batch.submit(r.job(first[r.rid]))
        for r in reqs[1:]:
            assert r.released.wait(600), r.rid
        for r in later:  # slot 1 again, while the greedy request still decodes
            batch.submit(r.job(first[r.rid]))
        assert reqs[0].released.wait(600) and later[0].released.wait(600)
        batch.submit(stopper.job(first["greedy"]))
        assert stopper.released.wait(60)
    finally:
        batch.close()
    for r in reqs:
        assert r.end == ("end", "length"), (r.rid, r.end)
        assert r.tokens == [t for t, _ in want[r.rid]], r.rid
    assert reqs[2].logprobs == [lp for _, lp in want["logprobs"]]
    c = later[0]
    assert c.end == ("end", "cancelled") and 2 <= len(c.tokens) < 39
    assert c.tokens == [t for t, _ in want["cancelled"]][:len(c.tokens)]
    assert stopper.end == ("end", "stop") and stopper.tokens == []
    assert runner.busy == [] and runner.replays >= len(want["greedy"])
    assert runner.buckets == [2, 3] and runner.bucket_replays[2] > 0  # slot 0 alone on the graph: 2 rows


def test_speculating_batch_greedy_jobs_on_the_round_graph_the_others_eager_rounds(ckpt_factory):
    """`--speculative mtp --max-batch B` on the graph path: greedy jobs run the batched round graph
    (engine/gpu/batch_round.py), a seeded sampled job its slot engine's eager round, in the same batch
    steps. The greedy tokens equal the one-token loop's alone, the sampled ones those of the same
    request alone on a speculating eager engine; the round graph drafted (rounds of > 1 token)."""
    path = ckpt_factory("qwen3_5", "bfloat16", **TRAINED_MTP["qwen3_5"])
    ref = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=MAX_LEN, progress=False)
    ref_spec = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=MAX_LEN, progress=False)
    ref_spec.enable_speculative("mtp", 2)
    reqs = [JobRequest("greedy", 0, periodic_prompt(19, seed=61), SamplingParams(max_tokens=12, ignore_eos=True)),
            JobRequest("sampled", 1, periodic_prompt(11, seed=62),
                       SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.8, seed=7)),
            JobRequest("greedy2", 2, periodic_prompt(25, seed=63), SamplingParams(max_tokens=9, ignore_eos=True))]
    first, want = {}, {}
    for r in reqs:
        e = ref_spec if r.params.temperature > 0 else ref
        first[r.rid] = int(e.prefill(r.prompt).argmax())
        want[r.rid] = [s.token for s in e.steps(first[r.rid], r.params)]

    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=MAX_LEN, progress=False)
    eng.enable_speculative("mtp", 2)
    runner = eng.batch_runner(SLOTS, CPU_TUNING)
    eng.use_batch(runner)
    batch = DecodeBatch(eng.slots(SLOTS))
    try:
        for r in reqs:
            batch.submit(r.job(first[r.rid]))
        for r in reqs:
            assert r.released.wait(900), r.rid
    finally:
        batch.close()
    for r in reqs:
        assert r.end == ("end", "length") and r.tokens == want[r.rid], (r.rid, r.end, r.tokens, want[r.rid])
    assert runner.busy == [] and runner.replays < len(want["greedy"])  # more than one token per round
