"""Hugging Face fine-grained FP8 checkpoints (e4m3 weights + fp32 `weight_scale_inv` per block):
the loader dequantizes them block-wise, so the engine on an FP8 checkpoint must decode exactly as the
engine on an fp32 checkpoint holding the dequantized values; malformed ones fail naming the tensor."""
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nexrt_vllm.engine import Engine
from nexrt_vllm.engine.config import ModelConfig
from nexrt_vllm.engine.errors import ConfigError, WeightsError
from nexrt_vllm.engine.weights import load_checkpoint
from nexrt_vllm.testing import FP8_NOT_CONVERT, make_fp8_checkpoint
from nexrt_vllm.testing.connector_harness import period_continuation, periodic_prompt

torch.set_num_threads(1)

# Block sizes that split the tiny dims unevenly (128 = 2*48 + 32, 128 = 3*40 + 8, 4-row gates...).
BLOCK = (48, 40)
# (family, shards, model.language_model. prefix): each layout the loader reads, once.
LAYOUTS = [("qwen3_next", 3, True), ("qwen3_5", 1, False), ("qwen3_5_moe", 2, True)]


def _tensors(path):
    out = {}
    for fname in sorted(os.listdir(path)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(path, fname), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _reference_dequant(q, s, bn, bk):
    """Block by block, independent of the loader's repeat_interleave."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = blk * s[i, j]
    return out


@pytest.fixture(scope="module")
def fp8_ckpts(ckpt_factory, tmp_path_factory):
    """family -> (source, fp8, dequantized fp32) checkpoint dirs."""
    out = {}
    for family, shards, prefix in LAYOUTS:
        src = ckpt_factory(family, "bfloat16")
        d = tmp_path_factory.mktemp(f"fp8_{family}")
        fp8 = make_fp8_checkpoint(src, str(d / "fp8"), block=BLOCK, shards=shards,
                                  language_model_prefix=prefix, dequantized_dir=str(d / "deq"))
        out[family] = (src, fp8, str(d / "deq"))
    return out


def _greedy(path, dtype, prompt, n=40):
    eng = Engine.from_pretrained(path, device="cpu", dtype=dtype, max_seq_len=256, progress=False)
    return eng.generate(prompt, n)


@pytest.mark.parametrize("family", [f for f, _, _ in LAYOUTS])
def test_format_as_published(fp8_ckpts, family):
    src, fp8, _ = fp8_ckpts[family]
    with open(os.path.join(fp8, "config.json")) as f:
        q = json.load(f)["quantization_config"]
    assert q == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": list(BLOCK), "modules_to_not_convert": list(FP8_NOT_CONVERT)}
    src_t, t = _tensors(src), _tensors(fp8)
    pre = "model.language_model." if any(k.startswith("model.language_model.") for k in t) else "model."
    n_fp8 = 0
    for name, w in src_t.items():
        name8 = pre + name[len("model."):] if name.startswith("model.") else name
        q8 = t[name8]
        kept = (w.dim() != 2 or "embed_tokens" in name or name == "lm_head.weight"
                or name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"))
        if kept:
            assert q8.dtype == torch.bfloat16 and torch.equal(q8, w), name
            assert name8 + "_scale_inv" not in t
            continue
        n_fp8 += 1
        s = t[name8 + "_scale_inv"]
        assert q8.dtype == torch.float8_e4m3fn and q8.shape == w.shape, name
        N, K = w.shape
        assert s.dtype == torch.float32 and tuple(s.shape) == (-(-N // BLOCK[0]), -(-K // BLOCK[1])), name
        # Rounding to e4m3 (3 mantissa bits) at scale amax/448: error at most half a step, 16 * scale.
        err = (_reference_dequant(q8, s, *BLOCK) - w.float()).abs()
        bound = s.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:N, :K] * 16.0001  # ties round in fp32
        assert (err <= bound).all(), name
        # The block amax maps to +-448 exactly (scale = amax / 448).
        assert q8.float().abs().amax() == 448.0, name
    assert n_fp8 > 10
    if family != "qwen3_5":
        assert sum(".experts." in k and k.endswith("_scale_inv") for k in t) > 0


@pytest.mark.parametrize("family", [f for f, _, _ in LAYOUTS])
def test_dequantized_weights_bit_exact(fp8_ckpts, family):
    _, fp8, deq = fp8_ckpts[family]
    cfg = ModelConfig.from_pretrained(fp8)
    assert cfg.quantization is not None and (cfg.quantization.block_n, cfg.quantization.block_k) == BLOCK
    got, _ = load_checkpoint(fp8, cfg, torch.float32, progress=False)
    want, _ = load_checkpoint(deq, ModelConfig.from_pretrained(deq), torch.float32, progress=False)
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), k
    # ... and the oracle's values are an independent block dequant of the stored e4m3 + scales.
    raw = _tensors(fp8)
    for name, q8 in raw.items():
        if q8.dtype == torch.float8_e4m3fn and ".experts." not in name:
            canon = name.split("language_model.", 1)[-1].removeprefix("model.")
            assert torch.equal(got[canon], _reference_dequant(q8, raw[name + "_scale_inv"], *BLOCK)), name
    # Stacked experts: expert j's gate rows then up rows, each dequantized with its own scales.
    if cfg.num_experts:
        layer = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
        p = next(k for k in raw if k.endswith(f"layers.{layer}.mlp.experts.1.up_proj.weight"))
        ref = _reference_dequant(raw[p], raw[p + "_scale_inv"], *BLOCK)
        assert torch.equal(got[f"layers.{layer}.mlp.experts.gate_up_proj"][1, cfg.moe_intermediate_size:], ref)


@pytest.mark.parametrize("family", [f for f, _, _ in LAYOUTS])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_equals_eager_on_dequantized(fp8_ckpts, family, dtype):
    src, fp8, deq = fp8_ckpts[family]
    prompt = list(range(3, 40, 2))
    got = _greedy(fp8, dtype, prompt)
    assert got == _greedy(deq, dtype, prompt)
    assert len(got) >= 32
    # Not vacuous: the quantized model is a different model from its bf16 source.
    if dtype == "float32":
        assert got != _greedy(src, dtype, prompt)


def test_trained_checkpoint_at_block_128(trained_ckpt, tmp_path):
    """The published block size on the trained tiny model (dims <= 128: one partial block per 64):
    FP8 == its dequantized oracle, and it still continues the period."""
    fp8 = make_fp8_checkpoint(trained_ckpt, str(tmp_path / "fp8"), block=128, dequantized_dir=str(tmp_path / "deq"))
    for seed, n in ((3, 40), (11, 120)):
        prompt = periodic_prompt(n, seed=seed)
        got = _greedy(fp8, "float32", prompt, 33)
        assert got == _greedy(str(tmp_path / "deq"), "float32", prompt, 33)
        assert got == period_continuation(prompt, 33)


# --- malformed checkpoints -----------------------------------------------------------------------

def _variant(src, dst, edit_tensors=None, edit_quant=None):
    """Copy single-file checkpoint `src` to `dst` with its tensors / quantization_config edited."""
    shutil.copytree(src, dst)
    if edit_tensors:
        t = _tensors(src)
        edit_tensors(t)
        save_file(t, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    if edit_quant:
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        edit_quant(cfg)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return dst


def _load(path):
    return Engine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=64, progress=False)


@pytest.fixture(scope="module")
def single_fp8(fp8_ckpts, ckpt_factory, tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8_single")
    return make_fp8_checkpoint(ckpt_factory("qwen3_5", "bfloat16"), str(d / "fp8"), block=BLOCK)


W = "model.layers.0.linear_attn.out_proj.weight"


@pytest.mark.parametrize("field,value,needle", [
    ("quant_method", "awq", "quant_method 'awq'"),
    ("fmt", "e5m2", "fmt 'e5m2'"),
    ("activation_scheme", "static", "activation_scheme 'static'"),
    ("weight_block_size", None, "weight_block_size"),
    ("weight_block_size", [128], "weight_block_size"),
])
def test_bad_quantization_config(single_fp8, tmp_path, field, value, needle):
    def edit(cfg):
        cfg["quantization_config"][field] = value
    bad = _variant(single_fp8, str(tmp_path / "bad"), edit_quant=edit)
    with pytest.raises(ConfigError, match="quantization_config") as e:
        _load(bad)
    assert needle in str(e.value)


def test_missing_scale_named(single_fp8, tmp_path):
    bad = _variant(single_fp8, str(tmp_path / "bad"), edit_tensors=lambda t: t.pop(W + "_scale_inv"))
    with pytest.raises(WeightsError, match="missing") as e:
        _load(bad)
    assert f"{W}_scale_inv (the block scales of float8 tensor {W})" in str(e.value)


def test_wrong_scale_shape_named(single_fp8, tmp_path):
    def edit(t):
        t[W + "_scale_inv"] = torch.ones(3, 3)  # out_proj [128, 256] at (48, 40): expected (3, 7)
    bad = _variant(single_fp8, str(tmp_path / "bad"), edit_tensors=edit)
    with pytest.raises(WeightsError, match="wrong shape") as e:
        _load(bad)
    assert f"{W}_scale_inv: checkpoint (3, 3), expected (3, 7)" in str(e.value)


def test_wrong_scale_dtype_named(single_fp8, tmp_path):
    def edit(t):
        t[W + "_scale_inv"] = t[W + "_scale_inv"].to(torch.float16)
    bad = _variant(single_fp8, str(tmp_path / "bad"), edit_tensors=edit)
    with pytest.raises(WeightsError, match=f"{W}_scale_inv: F16 \\(scales must be F32 or BF16\\)"):
        _load(bad)


def test_bf16_scales_load(single_fp8, tmp_path):
    """Qwen's FP8 releases store weight_scale_inv in bf16: widened exactly to fp32 at load."""
    def edit(t):
        for k in [k for k in t if k.endswith("_scale_inv")]:
            t[k] = t[k].to(torch.bfloat16)
    bf = _variant(single_fp8, str(tmp_path / "bf16_scales"), edit_tensors=edit)
    raw = _tensors(bf)
    got = _load(bf).model.layers[0].mixer.out_proj
    assert torch.equal(got, _reference_dequant(raw[W], raw[W + "_scale_inv"].float(), *BLOCK))


def test_orphan_scale_named(single_fp8, tmp_path):
    name = "model.layers.0.post_attention_layernorm.weight_scale_inv"
    bad = _variant(single_fp8, str(tmp_path / "bad"), edit_tensors=lambda t: t.update({name: torch.ones(1)}))
    with pytest.raises(WeightsError, match="unexpected") as e:
        _load(bad)
    assert f"{name} (a scale, but model.layers.0.post_attention_layernorm.weight is not a float8" in str(e.value)


def test_float8_in_modules_to_not_convert_named(single_fp8, tmp_path):
    def edit(cfg):
        cfg["quantization_config"]["modules_to_not_convert"].append("out_proj")
    bad = _variant(single_fp8, str(tmp_path / "bad"), edit_quant=edit)
    with pytest.raises(WeightsError, match=f"{W}: stored as float8 but listed in"):
        _load(bad)


def test_float8_norm_named(single_fp8, tmp_path):
    name = "model.norm.weight"

    def edit(t):
        t[name] = t[name].to(torch.float8_e4m3fn)
        t[name + "_scale_inv"] = torch.ones(1)
    bad = _variant(single_fp8, str(tmp_path / "bad"), edit_tensors=edit)
    with pytest.raises(WeightsError, match=f"{name}: float8 tensor of shape \\(128,\\)"):
        _load(bad)


def test_float8_without_quantization_config(single_fp8, tmp_path):
    bad = _variant(single_fp8, str(tmp_path / "bad"), edit_quant=lambda cfg: cfg.pop("quantization_config"))
    with pytest.raises(WeightsError, match="unsupported dtype") as e:
        _load(bad)
    assert f"{W}: F8_E4M3" in str(e.value) and "quantization_config" in str(e.value)


def test_config_round_trip(single_fp8):
    cfg = ModelConfig.from_pretrained(single_fp8)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.quantization.modules_to_not_convert == FP8_NOT_CONVERT


# --- kept in fp8 (the GPU path's format) ------------------------------------------------------------

@pytest.mark.parametrize("family", [f for f, _, _ in LAYOUTS])
def test_kept_fp8_dequantizes_to_the_oracle(fp8_ckpts, family):
    """load_checkpoint(keep_fp8): the projections stay e4m3 + scales (experts stacked from per-expert
    tensors, each keeping its gate / up scale grid) and dequantize to exactly the tensors the
    dequantize-at-load path returns; everything else is returned as before."""
    from nexrt_vllm.engine.fp8 import FP8Weight
    _, fp8, _ = fp8_ckpts[family]
    cfg = ModelConfig.from_pretrained(fp8)
    kept, _ = load_checkpoint(fp8, cfg, torch.bfloat16, progress=False, keep_fp8=True)
    want, _ = load_checkpoint(fp8, cfg, torch.bfloat16, progress=False)
    assert kept.keys() == want.keys()
    n_kept = 0
    for k, w in kept.items():
        if isinstance(w, FP8Weight):
            n_kept += 1
            assert w.q.dtype == torch.float8_e4m3fn and torch.equal(w.dequant(torch.bfloat16), want[k]), k
        else:
            assert torch.equal(w, want[k]), k
    assert n_kept > 10 and not isinstance(kept["embed_tokens.weight"], FP8Weight)
    if cfg.num_experts:
        layer = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
        gu = kept[f"layers.{layer}.mlp.experts.gate_up_proj"]
        I, bn = cfg.moe_intermediate_size, BLOCK[0]
        assert isinstance(gu, FP8Weight) and gu.q.shape == (cfg.num_experts, 2 * I, cfg.hidden_size)
        assert gu.srow.tolist() == [r // bn for r in range(I)] + [-(-I // bn) + r // bn for r in range(I)]


def test_kept_fp8_mtp_head(ckpt_factory, tmp_path):
    """The MTP head as the checkpoint stores it: its fp8 projections and per-expert tensors stay e4m3 + scales
    (the experts stacked by `mtp_weights`, each keeping its gate / up grid) and dequantize to exactly what the
    dequantize-at-load path builds; its fc (not a kept projection) is dequantized."""
    from nexrt_vllm.engine.fp8 import FP8Weight
    from nexrt_vllm.engine.spec.mtp import mtp_weights
    fp8 = make_fp8_checkpoint(ckpt_factory("qwen3_5_moe", "bfloat16", num_experts=4, num_experts_per_tok=2, mtp=True),
                              str(tmp_path / "fp8"), block=BLOCK)
    cfg = ModelConfig.from_pretrained(fp8)
    kept, kept_mtp = load_checkpoint(fp8, cfg, torch.bfloat16, progress=False, keep_fp8=True)
    want, want_mtp = load_checkpoint(fp8, cfg, torch.bfloat16, progress=False)
    assert kept_mtp.keys() == want_mtp.keys()
    assert not isinstance(kept_mtp["mtp.fc.weight"], FP8Weight)
    assert isinstance(kept_mtp["mtp.layers.0.self_attn.q_proj.weight"], FP8Weight)
    head, ref = (mtp_weights(cfg, m, t["embed_tokens.weight"], t["lm_head.weight"])
                 for m, t in ((kept_mtp, kept), (want_mtp, want)))
    for name in ("gate_up_proj", "down_proj"):
        w, r = getattr(head.layer.ffn, name), getattr(ref.layer.ffn, name)
        assert isinstance(w, FP8Weight) and torch.equal(w.dequant(torch.bfloat16), r), name
    assert torch.equal(head.fc, ref.fc)


def test_fp8_weights_switch(fp8_ckpts):
    from nexrt_vllm.engine.engine import keep_fp8
    _, fp8, _ = fp8_ckpts["qwen3_5"]
    cfg = ModelConfig.from_pretrained(fp8)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert keep_fp8("auto", cfg, cuda, torch.bfloat16) and not keep_fp8("auto", cfg, cuda, torch.float32)
    assert not keep_fp8("auto", cfg, cpu, torch.bfloat16) and keep_fp8("keep", cfg, cpu, torch.float32)
    assert not keep_fp8("dequantize", cfg, cuda, torch.bfloat16)
    assert not keep_fp8("keep", ModelConfig.from_pretrained(fp8_ckpts["qwen3_5"][0]), cuda, torch.bfloat16)
    # auto on CPU: dequantized at load, the oracle
    assert Engine.from_pretrained(fp8, device="cpu", max_seq_len=16, progress=False).weight_format == "bfloat16"
    with pytest.raises(ConfigError, match="fp8_weights must be one of"):
        Engine.from_pretrained(fp8, device="cpu", max_seq_len=16, progress=False, fp8_weights="fp8")


def test_mixed_expert_formats_dequantize_the_stack(tmp_path, ckpt_factory):
    """One expert's up_proj stored in bf16 among fp8 experts: that layer's stack is dequantized (the
    kernels take one format per stack), the rest stays fp8."""
    from nexrt_vllm.engine.fp8 import FP8Weight
    src = make_fp8_checkpoint(ckpt_factory("qwen3_5_moe", "bfloat16"), str(tmp_path / "moe"), block=BLOCK)
    name = next(k for k in _tensors(src) if k.endswith("layers.0.mlp.experts.1.up_proj.weight"))

    def edit(t):
        s = t.pop(name + "_scale_inv")
        t[name] = _reference_dequant(t[name], s, *BLOCK).to(torch.bfloat16)
    mixed = _variant(src, str(tmp_path / "mixed"), edit_tensors=edit)
    cfg = ModelConfig.from_pretrained(mixed)
    kept, _ = load_checkpoint(mixed, cfg, torch.bfloat16, progress=False, keep_fp8=True)
    assert not isinstance(kept["layers.0.mlp.experts.gate_up_proj"], FP8Weight)
    assert isinstance(kept["layers.1.mlp.experts.gate_up_proj"], FP8Weight)
    want, _ = load_checkpoint(mixed, cfg, torch.bfloat16, progress=False)
    assert torch.equal(kept["layers.0.mlp.experts.gate_up_proj"], want["layers.0.mlp.experts.gate_up_proj"])
