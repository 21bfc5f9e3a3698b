"""MTP speculative decoding in the eager engine (engine/spec/mtp.py, engine/spec/speculative.py): greedy
output equals the one-token loop token for token on trained tiny checkpoints of the three families
(with the drafter's full prompt context and without it, as after a hand-off); every acceptance
length commits the right state; sampled output keeps the target distribution (chi-square against
the exact distribution, with a check that the test rejects a wrong sampler); the trained head's
acceptance length; stops / max_tokens / a full context / logprobs as the plain loop; refusals."""
import random

import pytest
import torch
from scipy.stats import chi2

from nexrt_vllm.engine import ConfigError, Engine, NotBuiltError, SamplingParams, WeightsError
from nexrt_vllm.engine.spec.draft_vocab import describe_draft_vocab
from nexrt_vllm.engine.spec.speculative import Speculator, accept_sampled
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, period_continuation, periodic_prompt

torch.set_num_threads(1)

K = 3  # num_speculative_tokens: M = 4 verify positions


@pytest.fixture(scope="module")
def trained(ckpt_factory):
    """Trained checkpoints with a trained MTP head (connector_harness.TRAINED_MTP), by family."""
    return lambda arch: ckpt_factory(arch, "bfloat16", **TRAINED_MTP[arch])


def engine(path, spec=True, dtype="float32", max_seq_len=640):
    e = Engine.from_pretrained(path, dtype=dtype, max_seq_len=max_seq_len, progress=False)
    if spec:
        e.enable_speculative("mtp", K)
    return e


def handed_off(eng, prompt):
    """Prefill, then re-import the state: what a node holds after a hand-off (no MTP context)."""
    first = int(eng.prefill(prompt).argmax())
    n, st = eng.export_state()
    eng.import_state(n, st)
    return first


def handed_off_with_rows(eng, prompt):
    """The node after a hand-off from a speculating prefill vLLM: the state and the head's K/V rows
    0..N-1 (row N-1: the head on (H_{N-1}, the first token)), no hidden state."""
    first = int(eng.prefill(prompt).argmax())
    rows = eng.speculative.export_context(first)
    eng.import_state(*eng.export_state())
    eng.speculative.import_context(len(prompt), rows)
    return first


def mean_len(rounds):
    return sum(k * c for k, c in enumerate(rounds)) / max(1, sum(rounds))


def random_prompt(seed, n=30):
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_greedy_equals_plain_on_trained_checkpoints(trained, arch):
    path = trained(arch)
    plain, spec = engine(path, spec=False), engine(path)
    sp = SamplingParams(max_tokens=257, ignore_eos=True)
    for prompt in (periodic_prompt(40, seed=11), periodic_prompt(150, seed=12), random_prompt(13)):
        first = int(plain.prefill(prompt).argmax())
        want = list(plain.stream(first, sp))
        assert len(want) == 256
        # full context: the engine prefilled the prompt, the head saw it
        spec.speculative.rounds = [0] * (K + 2)
        assert int(spec.prefill(prompt).argmax()) == first
        assert list(spec.stream(first, sp)) == want
        full = spec.speculative.rounds
        # after a hand-off: no context
        spec.speculative.rounds = [0] * (K + 2)
        assert handed_off(spec, prompt) == first
        assert list(spec.stream(first, sp)) == want
        assert spec.finish_reason == plain.finish_reason == "length"
        if prompt != random_prompt(13):  # periodic text: drafts are accepted, often several at once
            assert sum(full[3:]) > 0 and sum(spec.speculative.rounds[3:]) > 0, (full, spec.speculative.rounds)


def test_bf16_greedy_equals_plain(trained):
    path = trained("qwen3_5")
    plain, spec = engine(path, spec=False, dtype="bfloat16"), engine(path, dtype="bfloat16")
    prompt = periodic_prompt(60, seed=5)
    want = plain.generate(prompt, 257, ignore_eos=True)
    assert spec.generate(prompt, 257, ignore_eos=True) == want == period_continuation(prompt, 257)


def test_every_acceptance_length_commits_the_right_state(trained, monkeypatch):
    """Drafts from an oracle (the plain continuation) with the first wrong draft at a scheduled
    place: rounds accept 0..3 drafts in turn; tokens equal the plain loop's and the state after the
    stream (GDN conv / recurrent, K/V rows) equals the one-token loop's at the same length."""
    path = trained("qwen3_5_moe")
    plain, spec = engine(path, spec=False), engine(path)
    prompt, N = random_prompt(21, 25), 25
    first = int(plain.prefill(prompt).argmax())
    ref = [first] + list(plain.stream(first, SamplingParams(max_tokens=80, ignore_eos=True)))
    V, calls = plain.config.vocab_size, []

    def oracle(self, hidden, tokens, base, a, params, gen):
        i = spec.state.seq_len - N  # the pending token is ref[i]
        good = len(calls) % (K + 1)  # this round: `good` right drafts, then wrong ones
        calls.append(good)
        d = [ref[i + 1 + j] if j < good else (ref[i + 1 + j] + 1) % V for j in range(K)]
        return torch.tensor(d), None

    monkeypatch.setattr(Speculator, "_draft", oracle)
    spec.prefill(prompt)
    got = list(spec.stream(first, SamplingParams(max_tokens=60, ignore_eos=True)))
    assert got == ref[1:60]
    assert all(spec.speculative.rounds[k] >= 3 for k in range(1, K + 2)), spec.speculative.rounds
    # the one-token loop to the same length
    n = spec.state.seq_len
    plain.prefill(prompt)
    for t in ref[:n - N]:
        plain.decode_step(t)
    assert plain.state.seq_len == n
    _, a = plain.export_state()
    _, b = spec.export_state()
    for name in a:
        err = (a[name].float() - b[name].float()).abs().max() / a[name].float().abs().max().clamp_min(1e-30)
        assert err < 1e-4, (name, float(err))


def test_stops_lengths_context_and_logprobs_as_plain(trained):
    path = trained("qwen3_next")
    plain, spec = engine(path, spec=False, max_seq_len=72), engine(path, max_seq_len=72)
    prompt = periodic_prompt(40, seed=31)
    first = int(plain.prefill(prompt).argmax())
    cont = period_continuation(prompt, 40)

    def both(sp):
        out = []
        for e in (plain, spec):
            e.prefill(prompt)
            out.append((list(e.steps(first, sp)), e.finish_reason))
        return out

    for mt in range(1, 9):
        (a, fa), (b, fb) = both(SamplingParams(max_tokens=mt, ignore_eos=True))
        assert [s.token for s in a] == [s.token for s in b] == cont[1:mt] and fa == fb == "length"
    for k in range(1, 8):  # a stop id at every offset within a round (or first_token itself)
        stop = cont[k]
        want = [] if stop == first else cont[1:cont.index(stop, 1) + 1]
        (a, fa), (b, fb) = both(SamplingParams(max_tokens=100, ignore_eos=True, stop_token_ids=(stop,)))
        assert [s.token for s in a] == [s.token for s in b] == want and fa == fb == "stop"
    # the context fills up: 72 - 40 = 32 decoded positions, the last rounds run one position each
    (a, fa), (b, fb) = both(SamplingParams(max_tokens=500, ignore_eos=True))
    assert [s.token for s in a] == [s.token for s in b] and len(b) == 32 and fa == fb == "length"
    (a, _), (b, _) = both(SamplingParams(max_tokens=30, ignore_eos=True, logprobs=3))
    for x, y in zip(a, b):
        assert x.token == y.token and abs(x.logprob - y.logprob) < 1e-4
        assert [i for i, _ in x.top] == [i for i, _ in y.top]
        assert all(abs(u - v) < 1e-4 for (_, u), (_, v) in zip(x.top, y.top))


def test_acceptance_length_of_the_trained_head(trained):
    """The trained head drafts the period: mean tokens per verify round > 1.5, with the prompt's MTP
    context (the engine prefilled it), with the head's rows shipped by a speculating vLLM (the node
    after such a hand-off: the first step plain), and without (the node after any other hand-off)."""
    spec = engine(trained("qwen3_next"))
    sp = SamplingParams(max_tokens=97, ignore_eos=True)
    start = {"full": lambda p: int(spec.prefill(p).argmax()), "rows": lambda p: handed_off_with_rows(spec, p),
             "none": lambda p: handed_off(spec, p)}
    stats = {}
    for mode in ("full", "rows", "none"):
        total = [0] * (K + 2)
        for seed in range(4):
            for n in (20, 120):
                prompt = periodic_prompt(n, seed=100 + 10 * seed + n)
                spec.speculative.rounds = [0] * (K + 2)
                first = start[mode](prompt)
                assert list(spec.stream(first, sp)) == period_continuation(prompt, 97)[1:]
                total = [x + y for x, y in zip(total, spec.speculative.rounds)]
        stats[mode] = (round(mean_len(total), 3), total)
    print("acceptance length (tokens per round), histogram [-, 1, 2, 3, 4]:", stats)
    assert all(v[0] > 1.5 for v in stats.values()), stats
    assert stats["rows"][0] > stats["none"][0], stats  # the shipped rows are attended to


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_fp8_draft_weights(trained, arch):
    """draft_weights="fp8": the head's projections (attention, MLP / experts; not the router) and a copy of the
    lm_head in block-scaled e4m3 for the single-row drafts, the head as stored kept for passes over several rows,
    the target's own weights untouched; greedy output is the plain engine's and the trained head's drafts are
    accepted as often as the stored head's."""
    from nexrt_vllm.engine.fp8 import FP8Weight

    path = trained(arch)
    plain, spec = engine(path, spec=False), engine(path, spec=False)
    spec.enable_speculative("mtp", K, draft_weights="fp8")
    w = spec.speculative.drafter.w
    mixer, ffn = w.layer.mixer, w.layer.ffn
    projections = [mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.o_proj] + (
        [ffn.gate_up_proj, ffn.down_proj, ffn.shared.gate_proj] if hasattr(ffn, "router")
        else [ffn.gate_proj, ffn.up_proj, ffn.down_proj])
    assert all(isinstance(p, FP8Weight) for p in projections)
    if hasattr(ffn, "router"):
        assert isinstance(ffn.router, torch.Tensor) and isinstance(ffn.shared_gate, torch.Tensor)
    assert isinstance(w.fc, torch.Tensor) and isinstance(spec.model.lm_head, torch.Tensor)
    # passes over several rows (the prompt, the verified rows) read the head as stored
    stored = w.rows
    assert stored is w.stored and stored.lm_head is spec.model.lm_head
    assert isinstance(stored.layer.mixer.q_proj, torch.Tensor) and stored.fc is w.fc
    head = w.lm_head.dequant(torch.float32)
    err = (head - spec.model.lm_head).abs().max() / spec.model.lm_head.abs().max()
    assert 0 < err < 1 / 16, err  # e4m3: 3 mantissa bits
    as_stored = engine(path)
    sp = SamplingParams(max_tokens=129, ignore_eos=True)
    total = {e: [0] * (K + 2) for e in (spec, as_stored)}
    for prompt in (periodic_prompt(40, seed=11), periodic_prompt(120, seed=12), random_prompt(13)):
        first = int(plain.prefill(prompt).argmax())
        want = list(plain.stream(first, sp))
        for e in (spec, as_stored):
            e.speculative.rounds = [0] * (K + 2)
            assert int(e.prefill(prompt).argmax()) == first
            assert list(e.stream(first, sp)) == want
            if prompt != random_prompt(13):
                total[e] = [x + y for x, y in zip(total[e], e.speculative.rounds)]
    fp8, stored = mean_len(total[spec]), mean_len(total[as_stored])
    print(f"acceptance length: fp8 head {fp8:.3f} {total[spec]}, as stored {stored:.3f} {total[as_stored]}")
    assert fp8 > 0.9 * stored and fp8 > 1.5, total
    with pytest.raises(ConfigError, match=r"draft_weights must be one of \('checkpoint', 'fp8'\), got 'int4'"):
        spec.enable_speculative("mtp", K, draft_weights="int4")


# ---- sampling ---------------------------------------------------------------------------------

def _chi2_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Goodness of fit of observed counts to exact cell probabilities; cells expected < 5 merged."""
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for cell, p in probs.items():
        if p * n < 5:
            rest_o += counts.get(cell, 0)
            rest_e += p * n
        else:
            obs.append(counts.get(cell, 0))
            exp.append(p * n)
    stray = sum(c for cell, c in counts.items() if cell not in probs)  # impossible outcomes
    if stray:
        return 0.0
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return float(chi2.sf(stat, len(obs) - 1))


def _synthetic_run(p_of, q_of, L, M, gen, accept):
    """L tokens from a position-indexed target p_of(i) and drafter q_of(i) through rounds of M."""
    out = []
    while len(out) < L:
        i = len(out)
        q = torch.stack([q_of(i + j) for j in range(M - 1)])
        d = torch.multinomial(q, 1, generator=gen)[:, 0]
        p = torch.stack([p_of(i + j) for j in range(M)])
        a, toks = accept(p, q, d, gen)
        out += toks[:int(a) + 1].tolist()
    return tuple(out[:L])


def _naive_accept(p, q, d, gen):
    """A wrong sampler: rejected positions draw from p instead of the residual norm(max(0, p - q))."""
    M = p.shape[0]
    u = torch.rand(M - 1, generator=gen)
    acc = u * q.gather(1, d[:, None])[:, 0] < p[:-1].gather(1, d[:, None])[:, 0]
    a = torch.cumprod(acc.long(), 0).sum().reshape(1)
    fresh = torch.multinomial(p, 1, generator=gen)[:, 0]
    return a, torch.where(torch.arange(M) < a, torch.cat((d, d[:1])), fresh)


def test_rejection_sampler_keeps_the_target_distribution():
    """Synthetic target / drafter over 4 tokens: the joint law of the first 3 emitted tokens equals
    p_0 x p_1 x p_2 (64 cells, chi-square); the same test rejects a sampler that resamples from p."""
    torch.manual_seed(0)  # P and Q below
    V, M, L, n = 4, 4, 3, 6000
    P = torch.distributions.Dirichlet(torch.ones(V)).sample((8,))
    Q = torch.distributions.Dirichlet(torch.ones(V)).sample((8,))
    P[2] = Q[2]  # one position where target and drafter agree (no residual)
    exact = {}
    for cell in ((a, b, c) for a in range(V) for b in range(V) for c in range(V)):
        exact[cell] = float(P[0, cell[0]] * P[1, cell[1]] * P[2, cell[2]])
    for accept, ok in ((accept_sampled, True), (_naive_accept, False)):
        gen = torch.Generator().manual_seed(1)
        counts = {}
        for _ in range(n):
            s = _synthetic_run(lambda i: P[i], lambda i: Q[i], L, M, gen, accept)
            counts[s] = counts.get(s, 0) + 1
        pv = _chi2_pvalue(counts, exact, n)
        assert (pv > 1e-3) if ok else (pv < 1e-6), (accept.__name__, pv)


def _exact_joint(eng, state, first, sp, L):
    """The plain sampler's exact law of the first L tokens after `first` (top-k support only)."""
    from nexrt_vllm.engine.sampling import sampling_probs

    n0, st = state
    out = {}

    def walk(prefix, prob):
        if len(prefix) == L:
            out[tuple(prefix)] = prob
            return
        eng.import_state(n0, st)
        for t in [first] + prefix:
            logits = eng.decode_step(t)
        p = sampling_probs(logits, sp.temperature, sp.top_k, sp.top_p)
        for t in torch.nonzero(p).flatten().tolist():
            walk(prefix + [t], prob * float(p[t]))

    walk([], 1.0)
    return out


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (4, 0.85)])
def test_sampled_tokens_follow_the_plain_distribution(trained, top_k, top_p):
    """The trained checkpoint at a high temperature (so several tokens share the mass): the joint
    law of the first 3 tokens after the hand-off's first token, speculative with the full MTP
    context (the first verify round drafts 3 tokens), equals the plain sampler's exact law."""
    path = trained("qwen3_5")
    spec = engine(path)
    prompt = periodic_prompt(24, seed=77)
    sp = SamplingParams(max_tokens=4, temperature=4.0, top_k=top_k, top_p=top_p, ignore_eos=True)
    first = int(spec.prefill(prompt).argmax())
    state, ctx = spec.export_state(), spec.speculative.export_context()
    exact = _exact_joint(spec, state, first, sp, 3)
    assert 4 <= len(exact) <= 200 and abs(sum(exact.values()) - 1) < 1e-4
    n, counts = 1500, {}
    spec.speculative.rounds = [0] * (K + 2)
    for seed in range(n):
        spec.import_state(*state)
        spec.speculative.import_context(state[0], ctx)
        toks = tuple(spec.stream(first, SamplingParams(**{**sp.__dict__, "seed": seed})))
        counts[toks] = counts.get(toks, 0) + 1
    r = spec.speculative.rounds
    assert r[1] > 50 and sum(r[2:]) > 50, r  # both rejections and acceptances were exercised
    pv = _chi2_pvalue(counts, exact, n)
    assert pv > 1e-3, (pv, r)


# ---- refusals ---------------------------------------------------------------------------------

def test_refusals(ckpt_factory, tmp_path):
    no_head = Engine.from_pretrained(ckpt_factory("qwen3_5", "bfloat16"), dtype="float32", max_seq_len=64,
                                     progress=False)
    with pytest.raises(ConfigError, match="no MTP head"):
        no_head.enable_speculative("mtp", 3)
    path = ckpt_factory("qwen3_5", "bfloat16", mtp=True)
    e = Engine.from_pretrained(path, dtype="float32", max_seq_len=64, progress=False)
    with pytest.raises(ConfigError, match="unknown speculative method 'eagle'"):
        e.enable_speculative("eagle", 3)
    for bad in (0, 16, 2.0, True):
        with pytest.raises(ConfigError, match="num_speculative_tokens"):
            e.enable_speculative("mtp", bad)
    V = e.config.vocab_size
    for bad in (0, V + 1, 2.5, True, "32"):
        with pytest.raises(ConfigError, match="draft_vocab must be an int in"):
            e.enable_speculative("mtp", 3, draft_vocab=bad)
    # a draft token map: distinct ids in [0, vocab), 1-D, integers
    for bad, why in (([[1, 2], [3, 4]], r"token map must be 1-D, got shape \(2, 2\)"),
                     (torch.tensor([[1, 2]]), r"must be 1-D, got shape \(1, 2\)"),
                     ([], "token map is empty"),
                     ([3, 7, 3, 9, 7], r"ids must be distinct, repeated: \[3, 7\]"),
                     ([0, V], rf"ids must be in \[0, {V}\), got \[{V}\]"),
                     (torch.tensor([-1, 5]), r"ids must be in .*got \[-1\]"),
                     (list(range(V + 1)), f"has {V + 1} ids, more than the vocabulary's {V}"),
                     ([1.0, 2.0], "ids must be integers"),
                     (torch.tensor([1.0, 2.0]), "ids must be integers"),
                     ([1, True], "ids must be ints, got a bool")):
        with pytest.raises(ConfigError, match=why) as err:
            e.enable_speculative("mtp", 3, draft_vocab=bad)
        assert str(err.value).startswith("draft_vocab token map"), err.value
    assert e.speculative is None  # every refusal left the engine as it was
    for good in (V, [5, 0, 17], (9,), torch.randperm(V), torch.tensor([3, 1], dtype=torch.int32)):
        e.enable_speculative("mtp", 3, draft_vocab=good)
        assert e.draft_vocab is good  # kept as given: the graph round builds its lm_head rows from it
    assert describe_draft_vocab(None, V) == {"kind": "first", "size": V}
    assert describe_draft_vocab(1024, V) == {"kind": "first", "size": 1024}
    assert describe_draft_vocab([4, 2, 9], V) == {"kind": "map", "size": 3}
    e.speculative = None

    class EagerGraph:  # a graph path capturing the eager ops: the speculative round needs the fused one
        d = type("D", (), {"mode": "eager"})()
    e.graph = EagerGraph()
    with pytest.raises(NotBuiltError, match="runs the fused kernels"):
        e.enable_speculative("mtp", 3)
    e.graph = None
    bad = dict(e.model.mtp)
    bad["mtp.fc.weight"] = bad["mtp.fc.weight"][:, :10]
    del bad["mtp.norm.weight"]
    e.model.mtp = bad
    with pytest.raises(WeightsError,
                       match=r"mtp.fc.weight: shape \(128, 10\), expected \(128, 256\).*missing mtp.norm"):
        e.enable_speculative("mtp", 3)
