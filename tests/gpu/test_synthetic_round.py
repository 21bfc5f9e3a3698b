"""The captured round under a pinned acceptance schedule (kernels/spec.accept with forced counts), on
CPU through the Triton interpreter: it emits what the eager loop emits under the same schedule (the
drafts it was told to accept, then the target's token), round for round, and a placeholder first
round (no head context) accepts nothing; the batched round (each slot's forced counts) as well."""
import torch

from nexrt_vllm.engine import Engine, SamplingParams, kernels
from nexrt_vllm.engine.gpu.decoder import FusedDecoder
from nexrt_vllm.engine.gpu.runner import GraphRunner
from nexrt_vllm.engine.gpu.spec_round import SpecRunner
from nexrt_vllm.engine.spec.synthetic import SyntheticAcceptance
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, periodic_prompt

from test_fused_speculative import CPU_TUNING

kernels.load(interpret=True)
torch.set_num_threads(1)


def test_graph_round_takes_the_schedule_as_the_eager_loop_does(ckpt_factory):
    path = ckpt_factory("qwen3_5", "bfloat16", **TRAINED_MTP["qwen3_5"])
    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=80, progress=False)
    prompt = periodic_prompt(40, seed=13)
    first = int(eng.prefill(prompt).argmax())
    target = list(eng.stream(first, SamplingParams(max_tokens=2, ignore_eos=True)))  # the plain loop's next token
    sp = SamplingParams(max_tokens=9, ignore_eos=True)
    rates = (1.0, 0.6, 0.3)
    eng.enable_speculative("mtp", 3, synthetic=SyntheticAcceptance(rates, seed=4))
    eng.prefill(prompt)
    want = list(eng.stream(first, sp))
    want_rounds = list(eng.speculative.rounds)
    eng.enable_speculative("mtp", 3, synthetic=SyntheticAcceptance(rates, seed=4))
    eng.graph = GraphRunner(FusedDecoder(eng.model, eng.state, mode="fused", tuning=CPU_TUNING))
    eng.spec_graph = SpecRunner(eng.graph, eng.speculative)
    eng.prefill(prompt)
    assert list(eng.stream(first, sp)) == want
    assert eng.speculative.rounds == want_rounds and sum(want_rounds) >= 2
    # after a hand-off the first round's drafts are placeholders: it accepts none, whatever the schedule
    eng.speculative.synthetic = SyntheticAcceptance((1.0, 1.0, 1.0))
    eng.prefill(prompt)
    eng.import_state(*eng.export_state())
    eng.speculative.rounds = [0] * 5
    assert list(eng.stream(first, SamplingParams(max_tokens=2, ignore_eos=True))) == target


def test_batched_round_takes_the_schedule_as_the_eager_loop_does(ckpt_factory):
    """The batched round (gpu/batch_round.py, each slot's forced counts) under the same schedule: a request
    emits what the eager loop emits, round for round."""
    from nexrt_vllm.engine.gpu.batch_round import BatchRoundRunner

    path = ckpt_factory("qwen3_5", "bfloat16", **TRAINED_MTP["qwen3_5"])
    rates, sp = (1.0, 0.6, 0.3), SamplingParams(max_tokens=9, ignore_eos=True)
    prompt = periodic_prompt(40, seed=14)
    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=80, progress=False)
    first = int(eng.prefill(prompt).argmax())
    eng.enable_speculative("mtp", 3, synthetic=SyntheticAcceptance(rates, seed=4))
    eng.prefill(prompt)
    want = list(eng.stream(first, sp))
    want_rounds = list(eng.speculative.rounds)
    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=80, progress=False)
    eng.enable_speculative("mtp", 3, synthetic=SyntheticAcceptance(rates, seed=4))
    runner = eng.batch_runner(2, CPU_TUNING)
    assert isinstance(runner, BatchRoundRunner) and runner.d.forced is not None
    eng.use_batch(runner)
    eng.slots(2)[1].prefill(prompt)
    assert list(runner.generate(1, first, sp)) == want
    assert runner.speculators[1].rounds == want_rounds and sum(want_rounds) >= 2
