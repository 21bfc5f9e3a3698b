"""nexrt_vllm/bench/graft.py: a tiny checkpoint carried into a larger Qwen3.5 shape computes the same function."""
import copy

import pytest
import torch

from nexrt_vllm.bench.graft import GraftError, graft, tiny_overrides
from nexrt_vllm.engine import Engine
from nexrt_vllm.engine.config import ModelConfig
from nexrt_vllm.engine.model import Model
from nexrt_vllm.engine.weights import load_checkpoint
from nexrt_vllm.testing import make_checkpoint

# Real-like shapes at a CPU size: wider hidden, head_dim 256 with 25 % rotary (= the tiny head_dim
# 64 at 100 %), more heads per kv head, 128-wide GDN heads, more layers, larger vocabulary. eps 1e-30
# in both: a zero-padded head's mean square is smaller, so the per-head norms' eps weighs more there,
# and a random tiny model's GDN outputs can be ~1e-5 (a trained model's are far above any eps).
_MID = dict(vocab_size=1000, hidden_size=512, num_hidden_layers=8, head_dim=256, num_attention_heads=8,
            num_key_value_heads=2, linear_num_key_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-30, hidden_act="silu",
            max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
MID = {
    "qwen3_5": dict(_MID, architectures=["Qwen3_5ForCausalLM"], linear_num_value_heads=4, intermediate_size=1024,
                    tie_word_embeddings=True),
    "qwen3_5_moe": dict(_MID, architectures=["Qwen3_5MoeForCausalLM"], linear_num_value_heads=8, num_experts=16,
                        num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                        tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(MID))
def tiny(request, tmp_path_factory):
    arch = request.param
    d = str(tmp_path_factory.mktemp(arch))
    tied = dict(tie_word_embeddings=True) if MID[arch]["tie_word_embeddings"] else {}  # untrained: tie it here
    make_checkpoint(d, arch=arch, dtype="float32", rms_norm_eps=1e-30, **tiny_overrides(MID[arch]), **tied)
    cfg = ModelConfig.from_pretrained(d)
    return arch, cfg, load_checkpoint(d, cfg, torch.float32, progress=False)[0]


def _engine(cfg, tensors):
    return Engine(cfg, Model(cfg, tensors, 128), 128)


def test_graft_is_the_tiny_function_in_fp32(tiny):
    torch.set_num_threads(1)
    arch, tcfg, tt = tiny
    rcfg = ModelConfig.from_dict(MID[arch])
    small, big = _engine(tcfg, tt), _engine(rcfg, graft(tt, tcfg, rcfg, torch.float32, extra_scale=0.0))
    prompt = [5, 17, 3, 99, 42, 7, 11, 23, 5, 17]
    a, b = small.prefill(prompt), big.prefill(prompt)
    V = tcfg.vocab_size
    assert float((b[:V] - a).norm() / a.norm()) < 1e-4
    for tok in (3, 99, 250):
        a, b = small.decode_step(tok), big.decode_step(tok)
        assert float((b[:V] - a).norm() / a.norm()) < 1e-4
    assert float(b[V:].std()) == pytest.approx(0.3, rel=0.25)  # the extra vocabulary's logits


def test_graft_bf16_with_small_random_extras_stays_close(tiny):
    torch.set_num_threads(1)
    arch, tcfg, tt = tiny
    rcfg = ModelConfig.from_dict(MID[arch])
    big = _engine(rcfg, graft(tt, tcfg, rcfg, torch.bfloat16, extra_scale=0.1))
    ref = _engine(tcfg, tt)
    prompt = [5, 17, 3, 99, 42, 7, 11, 23]
    la, lb = ref.prefill(prompt), big.prefill(prompt)
    assert float((lb[:tcfg.vocab_size] - la).norm() / la.norm()) < 0.1
    # an extra scale of 1 makes the random layers as loud as the grafted ones: the function is lost
    noisy = _engine(rcfg, graft(tt, tcfg, rcfg, torch.bfloat16, extra_scale=1.0))
    ln = noisy.prefill(prompt)
    assert float((ln[:tcfg.vocab_size] - la).norm() / la.norm()) > 0.1


def test_graft_refuses_what_it_cannot_carry(tiny):
    arch, tcfg, tt = tiny
    bad = copy.deepcopy(MID[arch])
    bad["rope_parameters"]["partial_rotary_factor"] = 0.5
    with pytest.raises(GraftError, match="RoPE"):
        graft(tt, tcfg, ModelConfig.from_dict(bad), torch.float32)
    if arch == "qwen3_5_moe":
        bad = dict(MID[arch], num_experts=32)
        with pytest.raises(GraftError, match="MoE"):
            graft(tt, tcfg, ModelConfig.from_dict(bad), torch.float32)


def test_decode_bench_train_graft_keeps_present_checkpoints_and_needs_a_dir(tmp_path, capsys):
    """`decode_bench --train-graft` trains only the graft checkpoints DIR lacks, on this machine, and exits
    before asking for a GPU; a checkpoint already there (its config.json) is left as it is."""
    from benchmarks import decode_bench
    from nexrt_vllm.bench.shapes import GRAFT_ARCH

    for key in ("2b", "35b"):
        d = tmp_path / GRAFT_ARCH[key]
        d.mkdir()
        (d / "config.json").write_text("{}")
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    assert decode_bench.main(["--shapes", "2b,35b", "--graft", str(tmp_path), "--train-graft"]) == 0
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before
    for argv, why in ((["--shapes", "2b", "--train-graft"], "--train-graft needs --graft DIR"),
                      (["--shapes", "7b", "--graft", str(tmp_path), "--train-graft"], "no graft family"),
                      (["--shapes", "2b"], "--json is required")):
        with pytest.raises(SystemExit) as e:
            decode_bench.main(argv)
        assert e.value.code == 2 and why in capsys.readouterr().err
