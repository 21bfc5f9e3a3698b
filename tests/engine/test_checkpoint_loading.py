"""Checkpoint loading: the layouts real checkpoints use load to the same model, and every kind of
corruption gives one clear error that names each problem."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nexrt_vllm.engine import ConfigError, Engine, ModelConfig, WeightsError

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


def _tensors(path):
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        out = {}
        for f in set(json.load(open(index))["weight_map"].values()):
            out.update(load_file(os.path.join(path, f)))
        return out
    return load_file(os.path.join(path, "model.safetensors"))


def _rewrite(src, dst, edit_tensors=None, edit_config=None):
    """Copy checkpoint `src` to `dst` as a single file, passing its tensors / config through the edits."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith((".safetensors", ".index.json")):
            shutil.copy(os.path.join(src, f), dst)
    tensors = _tensors(src)
    if edit_tensors:
        tensors = edit_tensors(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"))
    if edit_config:
        cfg = json.load(open(os.path.join(src, "config.json")))
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(edit_config(cfg), f)
    return str(dst)


def _logits(path, **kw):
    return Engine.from_pretrained(path, max_seq_len=32, progress=False, **kw).prefill(PROMPT)


# ---- layouts that must load ---------------------------------------------------------------------

def test_sharded_checkpoint_equals_single_file(ckpt_factory):
    single = ckpt_factory("qwen3_next", "bfloat16")
    sharded = ckpt_factory("qwen3_next", "bfloat16", sharded=True)
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    assert torch.equal(_logits(single), _logits(sharded))


def test_vl_checkpoint_layout_with_vision_and_mtp(ckpt_factory, tmp_path):
    """Qwen3.5 releases are *ForConditionalGeneration: text weights under model.language_model.,
    a vision tower under model.visual., an MTP head under mtp., the text config nested."""
    src = ckpt_factory("qwen3_5", "bfloat16")
    mtp = {"mtp.fc.weight": torch.randn(128, 256).bfloat16(), "mtp.norm.weight": torch.ones(128).bfloat16()}

    def tensors(t):
        out = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in t.items()}
        out["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2).bfloat16()
        return {**out, **mtp}

    def config(c):
        c.pop("architectures")
        return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                "text_config": {**c, "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1},
                "vision_config": {"depth": 1}, "tie_word_embeddings": False}

    vl = _rewrite(src, tmp_path / "vl", tensors, config)
    eng = Engine.from_pretrained(vl, max_seq_len=32, progress=False)
    assert eng.config.family == "qwen3_5" and eng.config.mtp_num_layers == 1
    assert set(eng.model.mtp) == set(mtp) and all(t.dtype == torch.bfloat16 for t in eng.model.mtp.values())
    assert torch.equal(eng.prefill(PROMPT), _logits(src))


def test_stacked_experts_equal_per_expert(ckpt_factory, tmp_path):
    src = ckpt_factory("qwen3_5_moe", "bfloat16")
    cfg = ModelConfig.from_pretrained(src)

    def stack(t):
        out = {k: v for k, v in t.items() if ".experts." not in k}
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}.mlp.experts."
            out[p + "gate_up_proj"] = torch.stack([
                torch.cat([t[f"{p}{j}.gate_proj.weight"], t[f"{p}{j}.up_proj.weight"]]) for j in range(cfg.num_experts)])
            out[p + "down_proj"] = torch.stack([t[f"{p}{j}.down_proj.weight"] for j in range(cfg.num_experts)])
        return out

    assert torch.equal(_logits(_rewrite(src, tmp_path / "stacked", stack)), _logits(src))


def test_dtype_cast_and_default(ckpt_factory, capsys):
    path = ckpt_factory("qwen3_5", "bfloat16")
    eng = Engine.from_pretrained(path, max_seq_len=32)  # dtype None -> the checkpoint's (bf16)
    assert "Loading weights" in capsys.readouterr().err  # tqdm progress bar
    assert eng.model.embed.dtype == torch.bfloat16 and eng.state.gdn(0).conv.dtype == torch.bfloat16
    for dt in ("float32", torch.float16):
        e = Engine.from_pretrained(path, dtype=dt, max_seq_len=32, progress=False)
        assert all(w.dtype == e.dtype for w in (e.model.embed, e.model.layers[0].mixer.in_proj_qkv))
        assert torch.isfinite(e.prefill(PROMPT)).all()
    with pytest.raises(ConfigError, match="unsupported dtype"):
        Engine.from_pretrained(path, dtype=torch.int8, progress=False)


def test_tied_embeddings_share_the_head(ckpt_factory):
    eng = Engine.from_pretrained(ckpt_factory("qwen3_5", "bfloat16", tie_word_embeddings=True),
                                 max_seq_len=32, progress=False)
    assert eng.model.lm_head is eng.model.embed


def test_from_config_random_weights(ckpt_factory):
    cfg = ModelConfig.from_pretrained(ckpt_factory("qwen3_5_moe", "bfloat16"))
    a = Engine.from_config(cfg.to_dict(), dtype="float32", max_seq_len=32, seed=3)
    b = Engine.from_config(cfg, dtype=torch.float32, max_seq_len=32, seed=3)
    c = Engine.from_config(cfg, dtype=torch.float32, max_seq_len=32, seed=4)
    assert a.config == cfg
    la, lb, lc = a.prefill(PROMPT), b.prefill(PROMPT), c.prefill(PROMPT)
    assert torch.equal(la, lb) and not torch.equal(la, lc)
    assert torch.isfinite(a.decode_step(int(la.argmax()))).all()
    std = float(a.model.layers[0].mixer.in_proj_qkv.std())
    assert 0.015 < std < 0.025


# ---- corrupted checkpoints ------------------------------------------------------------------------

def test_missing_misshaped_unexpected_reported_together(ckpt_factory, tmp_path):
    src = ckpt_factory("qwen3_next", "bfloat16")

    def corrupt(t):
        del t["model.layers.1.linear_attn.A_log"]
        del t["model.layers.0.mlp.experts.3.up_proj.weight"]
        t["model.layers.3.self_attn.k_proj.weight"] = t["model.layers.3.self_attn.k_proj.weight"][:64]
        t["model.layers.2.mlp.bogus.weight"] = torch.zeros(2)
        t["model.layers.0.mlp.experts.9.down_proj.weight"] = torch.zeros(128, 64).bfloat16()
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int8)
        return t

    with pytest.raises(WeightsError) as e:
        Engine.from_pretrained(_rewrite(src, tmp_path / "bad", corrupt), progress=False)
    msg = str(e.value)
    assert "missing (2):" in msg and "layers.1.linear_attn.A_log" in msg
    assert "layers.0.mlp.experts.3.up_proj.weight" in msg
    assert "unexpected (2):" in msg and "model.layers.2.mlp.bogus.weight" in msg
    assert "model.layers.0.mlp.experts.9.down_proj.weight" in msg
    assert "wrong shape (1):" in msg and "k_proj.weight: checkpoint (64, 128), expected (128, 128)" in msg
    assert "unsupported dtype (1):" in msg and "model.norm.weight: I8" in msg


def test_untied_checkpoint_without_lm_head(ckpt_factory, tmp_path):
    src = ckpt_factory("qwen3_5", "bfloat16")
    bad = _rewrite(src, tmp_path / "nohead", lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    with pytest.raises(WeightsError, match=r"missing \(1\):\n    lm_head.weight"):
        Engine.from_pretrained(bad, progress=False)


def test_bad_index_files(ckpt_factory, tmp_path):
    src = ckpt_factory("qwen3_next", "bfloat16", sharded=True)
    index = "model.safetensors.index.json"
    cases = {
        "not_json": ("{ not json", "not valid JSON"),
        "no_map": (json.dumps({"metadata": {}}), "no 'weight_map' object"),
        "bad_map": (json.dumps({"weight_map": {"a": 3}}), "must map tensor names to file names"),
        "lost_shard": (json.dumps({"weight_map": {"model.norm.weight": "model-00009-of-00009.safetensors"}}),
                       r"shard files that do not exist: \['model-00009-of-00009.safetensors'\]"),
    }
    for name, (text, msg) in cases.items():
        d = tmp_path / name
        shutil.copytree(src, d)
        (d / index).write_text(text)
        with pytest.raises(WeightsError, match=msg):
            Engine.from_pretrained(str(d), progress=False)
    # an index that promises a tensor its shard lacks
    d = tmp_path / "liar"
    shutil.copytree(src, d)
    idx = json.loads((d / index).read_text())
    name = "model.layers.0.linear_attn.dt_bias"
    idx["weight_map"][name] = next(f for f in sorted(set(idx["weight_map"].values())) if f != idx["weight_map"][name])
    (d / index).write_text(json.dumps(idx))
    with pytest.raises(WeightsError, match=r"model.layers.0.linear_attn.dt_bias \(listed in the index but absent"):
        Engine.from_pretrained(str(d), progress=False)


def test_unreadable_or_absent_weights(ckpt_factory, tmp_path):
    src = ckpt_factory("qwen3_5", "bfloat16")
    d = tmp_path / "garbage"
    shutil.copytree(src, d)
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(WeightsError, match="cannot read"):
        Engine.from_pretrained(str(d), progress=False)
    (d / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no model.safetensors or model.safetensors.index.json"):
        Engine.from_pretrained(str(d), progress=False)


@pytest.mark.parametrize("edit,msg", [
    (lambda c: {**c, "architectures": ["LlamaForCausalLM"]}, "unsupported architecture 'LlamaForCausalLM'"),
    (lambda c: {k: v for k, v in c.items() if k != "architectures"} | {"model_type": "llama"},
     "unsupported model_type 'llama'"),
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "missing required field 'hidden_size'"),
    (lambda c: {**c, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    (lambda c: {**c, "layer_types": ["full_attention"]}, "'layer_types' must list 4 entries"),
    (lambda c: {**c, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
    (lambda c: {**c, "vocab_size": "384"}, "'vocab_size' must be a positive int"),
    (lambda c: {"architectures": ["Qwen3_5ForConditionalGeneration"]}, "has no 'text_config' object"),
])
def test_bad_config_raises_config_error(ckpt_factory, tmp_path, edit, msg):
    src = ckpt_factory("qwen3_5", "bfloat16")
    d = tmp_path / "cfg"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(edit(cfg)))
    with pytest.raises(ConfigError, match=msg):
        Engine.from_pretrained(str(d), progress=False)


def test_config_variants_parse(ckpt_factory, tmp_path):
    """model_type without architectures, legacy top-level rope keys, generation_config EOS ids."""
    src = ckpt_factory("qwen3_next", "bfloat16")
    c = json.loads(open(os.path.join(src, "config.json")).read())
    base = ModelConfig.from_dict(c)
    legacy = {k: v for k, v in c.items() if k not in ("architectures", "rope_parameters", "layer_types")}
    legacy.update(rope_theta=1e7, partial_rotary_factor=0.25, full_attention_interval=4)
    d = tmp_path / "legacy"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(legacy))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    got = ModelConfig.from_pretrained(str(d))
    assert got.architecture == "qwen3_next" and got.eos_token_ids == (2, 0)
    assert (got.rope_theta, got.partial_rotary_factor, got.layer_types) == \
        (base.rope_theta, base.partial_rotary_factor, base.layer_types)
    (d / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(str(d))
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(str(tmp_path / "nowhere"))
