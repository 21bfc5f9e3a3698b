"""decode_bench's byte count of the fused step (MBU's numerator) against the model config alone: every
projection and the lm_head read once, the selected experts only, the GDN state read and written
once, the new K/V row written and rows 0..n read, the embedding row read (CPU, no kernel runs)."""
import pytest
import torch

from benchmarks.decode_bench import bytes_per_step
from nexrt_vllm.engine import DecodeState, Engine
from nexrt_vllm.engine.graph import FusedDecoder


def expected_bytes(c, n: int) -> int:
    bf, H = 2, c.hidden_size
    total = H * bf + c.vocab_size * H * bf  # embedding row, lm_head
    for i, kind in enumerate(c.layer_types):
        if kind == "linear_attention":
            nv = c.linear_num_value_heads
            w_in = (c.conv_dim + c.value_dim + 2 * nv) * H  # [q|k|v|z|b|a]
            conv_state, rec_state = c.conv_dim * (c.conv_kernel - 1) * bf, nv * c.linear_key_head_dim * \
                c.linear_value_head_dim * 4
            total += (w_in + c.conv_dim * c.conv_kernel + H * c.value_dim) * bf + 2 * conv_state + 2 * rec_state
        else:
            q, kv = 2 * c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim  # q rows with their gate rows
            total += (q + 2 * kv) * H * bf + H * c.num_heads * c.head_dim * bf  # qkv, o_proj
            total += 2 * kv * bf * (1 + n + 1)  # write the new row, read rows 0..n
        if c.is_moe_layer(i):
            E, I, Is = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
            total += (E + 1) * H * bf  # router + shared-expert gate
            total += c.num_experts_per_tok * (3 * I * H * bf) + 3 * Is * H * bf
        else:
            total += 3 * c.intermediate_size * H * bf
    return total


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_step_bytes_follow_the_model_config(ckpt_factory, arch):
    torch.set_num_threads(1)
    eng = Engine.from_pretrained(ckpt_factory(arch, "bfloat16"), device="cpu", dtype="bfloat16", max_seq_len=128,
                                 progress=False)
    dec = FusedDecoder(eng.model, eng.state)
    for n in (0, 100):
        got = bytes_per_step(dec, n)
        assert got["total"] == sum(v for k, v in got.items() if k != "total")
        assert got["total"] == expected_bytes(eng.config, n), (n, got)
    grow = bytes_per_step(dec, 100)["attn_splitk+combine"] - bytes_per_step(dec, 0)["attn_splitk+combine"]
    assert grow == len(eng.config.attention_layers) * 100 * 2 * eng.config.num_kv_heads * eng.config.head_dim * 2


@pytest.mark.parametrize("shape", ["2b", "35b"])
def test_step_bytes_at_the_benchmarked_shapes(shape):
    """The real shapes decode_bench measures, built on the meta device (no memory, no kernel runs)."""
    from benchmarks.decode_bench import SHAPES
    from nexrt_vllm.engine import ModelConfig
    from nexrt_vllm.engine.model import Model
    from nexrt_vllm.engine.weights import expected_shapes

    cfg, n = ModelConfig.from_dict(SHAPES[shape]), 8192
    weights = {k: torch.empty(v, dtype=torch.bfloat16, device="meta") for k, v in expected_shapes(cfg).items()}
    dec = FusedDecoder(Model(cfg, weights, n + 1), DecodeState(cfg, n + 1, torch.bfloat16, "meta"))
    assert bytes_per_step(dec, n)["total"] == expected_bytes(cfg, n)
