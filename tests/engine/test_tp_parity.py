"""Tensor-parallel engine (nexrt_vllm.engine.tp): TP = 2 and 4 over torch.distributed (gloo), one
process per rank, yields the greedy tokens of TP = 1 and of transformers, in fp32 on random tiny
checkpoints of the three families and in bf16 on the trained checkpoint; a state handed in as shards
(re-sharded from a TP = 1 prefill) continues identically; each rank's state is its shard.

One group of 4 ranks serves the module (this process is rank 0; TP = 2 runs on ranks 0-1)."""
import pytest
import torch

from nexrt_vllm.engine import Engine
from nexrt_vllm.engine.errors import ConfigError, StateError
from nexrt_vllm.engine.tp import Group, local_config
from nexrt_vllm.node import reshard as R
from nexrt_vllm.testing import TP_SHAPES, _model_class
from nexrt_vllm.testing.connector_harness import TRAINED, period_continuation, periodic_prompt

torch.set_num_threads(1)
N_NEW = 20
SHAPES = TP_SHAPES
PROMPT = [(i * 37 + 11) % 380 + 3 for i in range(70)]  # longer than one 64-token GDN chunk


@pytest.fixture(scope="module")
def group():
    g = Group(4, timeout=120)
    yield g
    g.close()


@pytest.fixture(scope="module")
def refs(ckpt_factory):
    """arch -> (path, TP = 1 tokens, transformers tokens), fp32."""
    cache = {}

    def get(arch):
        if arch not in cache:
            path = ckpt_factory(arch, "bfloat16", **SHAPES[arch])
            one = Engine.from_pretrained(path, dtype=torch.float32, max_seq_len=128, progress=False)
            cache[arch] = (path, one, one.generate(PROMPT, N_NEW, ignore_eos=True), _hf_greedy(path, arch, N_NEW))
        return cache[arch]

    return get


@torch.no_grad()
def _hf_greedy(path, arch, n):
    from transformers import DynamicCache

    kw = {} if arch == "qwen3_5" else {"experts_implementation": "eager"}
    model = _model_class(arch).from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kw).eval()
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([PROMPT]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    toks = [int(out.logits[0, -1].argmax())]
    while len(toks) < n:
        out = model(input_ids=torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True)
        toks.append(int(out.logits[0, -1].argmax()))
    return toks


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("arch", list(SHAPES))
def test_tp_greedy_equals_tp1_and_transformers_fp32(group, refs, arch, tp):
    path, one, want, hf = refs(arch)
    assert want == hf and len(set(want)) > 6
    eng = group.engine(tp, path=path, dtype=torch.float32, max_seq_len=128)
    lc = eng.model.config
    assert (lc.num_heads, lc.linear_num_key_heads) == (one.config.num_heads // tp, one.config.linear_num_key_heads // tp)
    assert eng.generate(PROMPT, N_NEW, ignore_eos=True) == want

    # each rank's state is its shard of the TP = 1 state (K/V heads, conv q|k|v per segment, rec heads)
    n, shards = eng.export_shards()
    one.prefill(PROMPT + want[:-1])
    n1, full = one.export_state()
    assert n == n1
    for r, (got, exp) in enumerate(zip(shards, R.split_state(one.config, full, R.node_shards(one.config, tp)))):
        assert sorted(got) == sorted(exp)
        for name in exp:
            err = (got[name] - exp[name]).abs().max() / exp[name].abs().max().clamp_min(1e-30)
            assert err < 1e-4, (r, name, float(err))

    # a hand-off: a TP = 1 prefill state re-sharded 1 -> tp continues as TP = 1 does
    first = int(one.prefill(PROMPT[:40]).argmax())
    n, full = one.export_state()
    eng.import_shards(n, R.split_state(one.config, full, R.node_shards(one.config, tp)))
    from nexrt_vllm.engine import SamplingParams
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    assert list(eng.stream(first, sp)) == list(one.stream(first, sp))


def test_tp_greedy_bf16_trained_checkpoint(group, ckpt_factory):
    path = ckpt_factory("qwen3_next", "bfloat16", **TRAINED)
    one = Engine.from_pretrained(path, dtype=torch.bfloat16, max_seq_len=256, progress=False)
    eng = group.engine(2, path=path, dtype=torch.bfloat16, max_seq_len=256)
    for seed in (1, 2):
        prompt = periodic_prompt(60, seed=seed)
        want = one.generate(prompt, 24)
        assert want == period_continuation(prompt, 24)
        assert eng.generate(prompt, 24) == want


def test_bad_splits_and_shards_are_refused(group, refs):
    path, one, _, _ = refs("qwen3_5")
    with pytest.raises(ConfigError, match="does not divide linear_num_key_heads"):
        local_config(one.config, 8)
    with pytest.raises(ConfigError, match="runs TP in"):
        group.engine(3, path=path)
    eng = group.engine(2, path=path, dtype=torch.float32, max_seq_len=128)
    one.prefill(PROMPT[:10])
    n, full = one.export_state()
    shards = R.split_state(one.config, full, R.node_shards(one.config, 2))
    with pytest.raises(StateError, match="1 shards for TP = 2"):
        eng.import_shards(n, shards[:1])
    bad = dict(shards[1], **{"layers.0.rec": shards[1]["layers.0.rec"][:1]})
    with pytest.raises(StateError, match="shard 1 .*layers.0.rec"):
        eng.import_shards(n, [shards[0], bad])
    # the group is still in step after the refusals
    eng.import_shards(n, shards)
    first = int(one.prefill(PROMPT[:10]).argmax())
    from nexrt_vllm.engine import SamplingParams
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    assert list(eng.stream(first, sp)) == list(one.stream(first, sp))
