"""Pinned (synthetic) acceptance, vLLM's semantics (engine/spec/synthetic.py): the schedule derived from a
mean length, its checks, its draws, and the eager speculative loop under it. It never changes a
normal run: without a schedule the loop is exact (test_mtp.py); with every rate 0 each round accepts
nothing and the output is still the target's own."""
import pytest
import torch

from nexrt_vllm.engine import ConfigError, Engine, SamplingParams
from nexrt_vllm.engine.spec.synthetic import SyntheticAcceptance, SyntheticAcceptanceError, check_rates, \
    rates_for_length
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, periodic_prompt

torch.set_num_threads(1)


def test_schedule_from_a_mean_length():
    assert rates_for_length(3.39, 3) == (1.0, 1.0, 0.39)  # InferenceX's golden value for Qwen3.5 MTP, 3 drafts
    assert rates_for_length(3.97, 4) == (1.0, 1.0, 0.97, 0.0)
    assert rates_for_length(4, 3) == (1.0, 1.0, 1.0)
    assert rates_for_length(1, 2) == (0.0, 0.0)
    assert SyntheticAcceptance.from_length(3.39, 3).length == pytest.approx(3.39)


@pytest.mark.parametrize("length, n", [(0.5, 3), (4.5, 3), (float("nan"), 3), (True, 3), (2.0, 0)])
def test_impossible_lengths_are_refused(length, n):
    with pytest.raises(SyntheticAcceptanceError):
        rates_for_length(length, n)


@pytest.mark.parametrize("rates, why", [((1.0, 0.5), "one per draft"), ((0.5, 0.7, 0.1), "non-increasing"),
                                        ((1.2, 1.0, 0.0), r"in \[0, 1\]"), (("a", 1, 1), "numbers")])
def test_bad_rates_are_refused_with_the_reason(rates, why):
    with pytest.raises(SyntheticAcceptanceError, match=why):
        check_rates(rates, 3)


def test_draws_follow_the_rates_and_the_seed():
    s = SyntheticAcceptance.from_length(3.39, 3, seed=7)
    d = s.draws(40000)
    assert set(d) == {2, 3}  # the minimum-variance schedule: 2 or 3 drafts, never fewer or more
    assert 1 + sum(d) / len(d) == pytest.approx(3.39, abs=0.01)
    assert SyntheticAcceptance.from_length(3.39, 3, seed=7).draws(100) == d[:100]
    s = SyntheticAcceptance((0.9, 0.5, 0.2), seed=1)
    d = s.draws(40000)
    for i, r in enumerate((0.9, 0.5, 0.2)):
        assert sum(k > i for k in d) / len(d) == pytest.approx(r, abs=0.01)


def _engines(ckpt_factory, arch="qwen3_5"):
    path = ckpt_factory(arch, "bfloat16", **TRAINED_MTP[arch])
    plain = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=160, progress=False)
    spec = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=160, progress=False)
    return plain, spec


def test_eager_rounds_take_the_pinned_counts(ckpt_factory):
    plain, eng = _engines(ckpt_factory)
    prompt = periodic_prompt(40, seed=21)
    first = int(plain.prefill(prompt).argmax())
    sp = SamplingParams(max_tokens=61, ignore_eos=True)
    want = list(plain.stream(first, sp))
    # every rate 0: nothing accepted, each round emits the target's token - exact
    eng.enable_speculative("mtp", 3, synthetic=SyntheticAcceptance((0.0, 0.0, 0.0)))
    eng.prefill(prompt)
    assert list(eng.stream(first, sp)) == want
    assert eng.speculative.rounds[1] > 0 and sum(eng.speculative.rounds[2:]) == 0
    # 3.39: every round emits 3 or 4 tokens, the first 2 or 3 of them the head's drafts
    sched = SyntheticAcceptance.from_length(3.39, 3, seed=3)
    expect = SyntheticAcceptance.from_length(3.39, 3, seed=3).draws(40)
    eng.enable_speculative("mtp", 3, synthetic=sched)
    eng.prefill(prompt)
    got = list(eng.stream(first, sp))
    assert len(got) == 60 and eng.finish_reason == "length"
    rounds = eng.speculative.rounds
    assert rounds[1] == rounds[2] == 0 and rounds[3] + rounds[4] >= 14
    assert [rounds[3], rounds[4]] == [expect[:sum(rounds)].count(2), expect[:sum(rounds)].count(3)]
    # sampled requests take the same schedule
    eng.enable_speculative("mtp", 3, synthetic=SyntheticAcceptance.from_length(3.39, 3, seed=3))
    eng.prefill(prompt)
    got = list(eng.stream(first, SamplingParams(max_tokens=21, temperature=0.8, seed=5, ignore_eos=True)))
    assert len(got) == 20 and eng.speculative.rounds[1] == eng.speculative.rounds[2] == 0


def test_schedule_must_match_the_draft_count(ckpt_factory):
    _, eng = _engines(ckpt_factory)
    with pytest.raises(ConfigError, match="one per draft"):
        eng.enable_speculative("mtp", 2, synthetic=SyntheticAcceptance.from_length(3.39, 3))
