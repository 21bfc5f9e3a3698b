"""Sampling on a known logits vector: filters, distributions (statistical, fixed seeds), validation."""
import math

import pytest
import torch

from nexrt_vllm.engine import Sampler, SamplingParams, SamplingParamsError, sampling_probs

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (descending, no ties at the top)
PROBS = torch.tensor([0.0625, 0.5, 0.125, 0.25, 0.0625])
LOGITS = PROBS.log()
N = 4000


def _freqs(params: SamplingParams, logits=LOGITS, n=N):
    s = Sampler(params)
    counts = torch.zeros(logits.shape[0])
    for _ in range(n):
        counts[s(logits)] += 1
    return counts / n


def _close(freqs, want, n=N):
    # 5 sigma of a binomial proportion per entry: flaky with probability ~1e-6
    tol = 5 * torch.sqrt(want * (1 - want) / n) + 1e-9
    assert torch.all((freqs - want).abs() <= tol), (freqs, want)


def test_greedy_is_argmax_first_index_on_ties():
    s = Sampler(SamplingParams(temperature=0.0))
    assert s(LOGITS) == 1
    assert s(torch.tensor([0.0, 3.0, 3.0, 1.0])) == 1


def test_temperature_one_follows_softmax():
    _close(_freqs(SamplingParams(temperature=1.0, seed=1)), PROBS)


@pytest.mark.parametrize("t", [0.5, 2.0])
def test_temperature_reshapes_distribution(t):
    want = torch.softmax(LOGITS / t, dim=-1)
    f = _freqs(SamplingParams(temperature=t, seed=2))
    _close(f, want)
    # sharper below 1, flatter above: the top token's share moves accordingly
    assert (f[1] > 0.6) if t < 1 else (f[1] < 0.42)


def test_top_k_two_never_leaves_top_two_and_renormalises():
    f = _freqs(SamplingParams(temperature=1.0, top_k=2, seed=3))
    assert f[[0, 2, 4]].sum() == 0
    _close(f, torch.tensor([0, 2 / 3, 0, 1 / 3, 0]))


def test_top_p_keeps_smallest_set_reaching_p():
    # 0.5 + 0.25 = 0.75 >= 0.7: only tokens 1 and 3 survive
    f = _freqs(SamplingParams(temperature=1.0, top_p=0.7, seed=4))
    assert f[[0, 2, 4]].sum() == 0
    _close(f, torch.tensor([0, 2 / 3, 0, 1 / 3, 0]))
    # a tiny top_p keeps the most likely token only
    assert torch.equal(sampling_probs(LOGITS, 1.0, top_p=1e-6), torch.tensor([0.0, 1, 0, 0, 0]))


def test_top_k_then_top_p():
    # top-3 renormalised: 4/7, 2/7, 1/7; top_p 0.8 then keeps 4/7 + 2/7 = 6/7
    p = sampling_probs(LOGITS, 1.0, top_k=3, top_p=0.8)
    assert torch.allclose(p, torch.tensor([0, 2 / 3, 0, 1 / 3, 0]))


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0))

    def draw(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [s(logits) for _ in range(50)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    assert len(set(draw(7))) > 20


@pytest.mark.parametrize("kwargs,msg", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=1.0), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(seed="1"), "seed"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(stop_token_ids=[1, -3]), "stop_token_ids"),
    (dict(stop_token_ids="12"), "stop_token_ids"),
])
def test_bad_params_raise_typed_error(kwargs, msg):
    with pytest.raises(SamplingParamsError, match=msg):
        SamplingParams(**kwargs)


def test_params_normalise_stop_ids_and_disable_filters():
    p = SamplingParams(stop_token_ids=[3, 4], top_k=-1)
    assert p.stop_token_ids == (3, 4) and p.greedy
    assert torch.allclose(sampling_probs(LOGITS, 1.0, top_k=-1, top_p=1.0), PROBS)
