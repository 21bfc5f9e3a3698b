"""The engine against transformers: greedy tokens and the state left by prefill.

HF runs with its eager attention and eager experts: transformers' reference implementations, whose op
order the engine mirrors (its default SDPA / grouped-mm kernels round differently in bf16, which
flips near-tied greedy tokens). With them the logits match bit for bit, so the token sequences must
be identical in fp32 and bf16 alike.
"""
import pytest
import torch

from nexrt_vllm.engine import Engine
from nexrt_vllm.testing import _model_class

N_NEW = 48
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Two shapes per architecture: layer count, attention interval, KV heads, GDN head grouping,
# experts / top-k, dense layers inside Qwen3-Next, tied embeddings. Shape "b" prompts are longer
# than one 64-token GDN chunk.
SHAPES = {
    ("qwen3_next", "a"): {},
    ("qwen3_next", "b"): dict(num_hidden_layers=6, full_attention_interval=3, num_key_value_heads=1,
                              linear_num_key_heads=1, linear_num_value_heads=3, num_experts=4,
                              num_experts_per_tok=3, decoder_sparse_step=2, tie_word_embeddings=True),
    ("qwen3_5", "a"): {},
    ("qwen3_5", "b"): dict(num_hidden_layers=5, full_attention_interval=2, num_key_value_heads=4,
                           linear_num_value_heads=2, intermediate_size=192, tie_word_embeddings=True),
    ("qwen3_5_moe", "a"): {},
    ("qwen3_5_moe", "b"): dict(num_hidden_layers=6, full_attention_interval=3, num_key_value_heads=1,
                               num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32),
}
PROMPTS = {"a": [5, 17, 42, 99, 7, 3, 250, 11, 64, 128, 200, 33],
           "b": [(i * 37 + 11) % 380 + 3 for i in range(70)]}


def _hf(path, arch, dtype):
    kw = {} if arch == "qwen3_5" else {"experts_implementation": "eager"}
    return _model_class(arch).from_pretrained(path, dtype=dtype, attn_implementation="eager", **kw).eval()


@torch.no_grad()
def _hf_prefill(model, prompt):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float(), cache


@torch.no_grad()
def _hf_greedy(model, prompt, n):
    logits, cache = _hf_prefill(model, prompt)
    toks = [int(logits.argmax())]
    while len(toks) < n:
        out = model(input_ids=torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True)
        toks.append(int(out.logits[0, -1].float().argmax()))
    return toks


def _case(ckpt_factory, arch, shape, dtype):
    path = ckpt_factory(arch, "bfloat16", **SHAPES[(arch, shape)])
    eng = Engine.from_pretrained(path, dtype=DTYPES[dtype], max_seq_len=160, progress=False)
    return eng, _hf(path, arch, DTYPES[dtype]), PROMPTS[shape]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch,shape", list(SHAPES))
def test_greedy_tokens_equal_transformers(ckpt_factory, arch, shape, dtype):
    eng, hf, prompt = _case(ckpt_factory, arch, shape, dtype)
    want = _hf_greedy(hf, prompt, N_NEW)
    got = eng.generate(prompt, max_new_tokens=N_NEW, ignore_eos=True)
    assert got == want
    assert len(set(got)) > 8, "degenerate sequence: the parity proves little"


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("arch,shape", [("qwen3_next", "b"), ("qwen3_5", "a"), ("qwen3_5_moe", "b")])
def test_prefill_state_matches_transformers_cache(ckpt_factory, arch, shape, dtype, tol):
    eng, hf, prompt = _case(ckpt_factory, arch, shape, dtype)
    for p in (prompt, prompt[:2]):  # also shorter than the conv window: HF left-pads with zeros
        want_logits, cache = _hf_prefill(hf, p)
        logits = eng.prefill(p)
        assert eng.state.seq_len == len(p) and int(eng.state.position) == len(p)
        assert logits.dtype == torch.float32 and logits.shape == (eng.config.vocab_size,)
        assert int(logits.argmax()) == int(want_logits.argmax())

        def rel(a, b):
            return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))

        for i, kind in enumerate(eng.config.layer_types):
            layer = cache.layers[i]
            if kind == "full_attention":
                kv = eng.state.attention(i)
                assert rel(kv.k[:, :len(p)], layer.keys[0]) <= tol
                assert rel(kv.v[:, :len(p)], layer.values[0]) <= tol
            else:
                # HF keeps `kernel` conv columns, the native layout the last kernel-1.
                hf_conv, hf_rec = layer.conv_states[0][0], layer.recurrent_states[0][0]
                assert hf_conv.shape[-1] == eng.config.conv_kernel
                s = eng.state.gdn(i)
                assert rel(s.conv, hf_conv[:, 1:]) <= tol
                assert s.rec.dtype == torch.float32
                assert s.rec.shape == hf_rec.shape  # [v_heads, dk, dv]
                assert rel(s.rec, hf_rec) <= tol
