"""decode_bench's byte count of the fused step (MBU's numerator) against the model config alone: every
projection and the lm_head read once, the selected experts only, the GDN state read and written
once, the new K/V row written and rows 0..n read, the embedding row read (CPU, no kernel runs)."""
import pytest
import torch

from nexrt_vllm.bench.step import bytes_per_step
from nexrt_vllm.engine import DecodeState, Engine
from nexrt_vllm.engine.gpu.decoder import FusedDecoder


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
    from nexrt_vllm.bench.shapes import SHAPES
    from nexrt_vllm.engine import ModelConfig
    from nexrt_vllm.engine.model import Model
    from nexrt_vllm.engine.weights import expected_shapes

    cfg, n = ModelConfig.from_dict(SHAPES[shape]), 8192
    weights = {k: torch.empty(v, dtype=torch.bfloat16, device="meta") for k, v in expected_shapes(cfg).items()}
    dec = FusedDecoder(Model(cfg, weights, n + 1), DecodeState(cfg, n + 1, torch.bfloat16, "meta"))
    assert bytes_per_step(dec, n)["total"] == expected_bytes(cfg, n)


@pytest.mark.parametrize("shape", ["2b", "35b"])
def test_tp_rank_step_bytes_are_its_shard(shape):
    """decode_bench --tp: a TP = 2 rank's step moves its shard's bytes (its heads, its 1/2 of every FFN
    and expert, its half of the lm_head) plus, after each mixer and FFN, the fp32 partial through the
    all-reduce and the residual add (meta device; no collective runs)."""
    from nexrt_vllm.bench.shapes import SHAPES
    from nexrt_vllm.engine import ModelConfig
    from nexrt_vllm.engine.gpu.tp import Collectives, TPDecoder
    from nexrt_vllm.engine.tp import TPModel, local_config, shard_weights, vocab_range
    from nexrt_vllm.engine.weights import expected_shapes

    cfg, n, tp = ModelConfig.from_dict(SHAPES[shape]), 8192, 2
    weights = {k: torch.empty(v, dtype=torch.bfloat16, device="meta") for k, v in expected_shapes(cfg).items()}
    lc, H = local_config(cfg, tp), cfg.hidden_size
    for rank in range(tp):
        model = TPModel(cfg, shard_weights(cfg, weights, tp, rank), n + 1, tp=tp, rank=rank)
        dec = TPDecoder(model, DecodeState(lc, n + 1, torch.bfloat16, "meta"), Collectives(tp, rank))
        a, b = vocab_range(cfg.vocab_size, tp, rank)
        reduce = 2 * len(cfg.layer_types) * (4 * H * 4 + 2 * H * 2)
        want = expected_bytes(lc, n) - (cfg.vocab_size - (b - a)) * H * 2 + reduce
        assert bytes_per_step(dec, n)["total"] == want, rank


def per_request_bytes(c, n: int) -> int:
    """What one more request adds to a batch step at context n (its experts apart): its embedding row, its
    GDN states read and written, its new K/V row and rows 0..n."""
    bf = 2
    total = c.hidden_size * bf
    for kind in c.layer_types:
        if kind == "linear_attention":
            total += 2 * c.conv_dim * (c.conv_kernel - 1) * bf
            total += 2 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        else:
            total += 2 * c.num_kv_heads * c.head_dim * bf * (1 + n + 1)
    return total


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_batch_step_bytes_read_the_weights_once(ckpt_factory, arch):
    """decode_bench --batch's byte count (bench/batch_step.py): with one slot live, the one-request step's
    bytes; each further live slot adds its own state traffic, not the weights; the experts are the
    distinct ones the batch chose."""
    from nexrt_vllm.bench.batch_step import batch_bytes
    from nexrt_vllm.engine.gpu.batch_decoder import BatchDecoder
    from nexrt_vllm.engine.state import StackedStates

    torch.set_num_threads(1)
    eng = Engine.from_pretrained(ckpt_factory(arch, "bfloat16"), device="cpu", dtype="bfloat16", max_seq_len=128,
                                 progress=False)
    c, n = eng.config, 100
    bd = BatchDecoder(eng.model, StackedStates(c, 4, 128, eng.dtype, eng.device))
    k = c.num_experts_per_tok
    moe = [i for i in range(len(c.layer_types)) if c.num_experts and c.is_moe_layer(i)]
    one = batch_bytes(bd, n, 1, {i: k for i in moe})
    assert one["total"] == expected_bytes(c, n)
    three = batch_bytes(bd, n, 3, {i: k for i in moe})
    assert three["total"] - one["total"] == 2 * per_request_bytes(c, n)
    if moe:  # two more distinct experts per layer: their gate_up and down rows
        more = batch_bytes(bd, n, 3, {i: k + 2 for i in moe})["total"] - three["total"]
        assert more == len(moe) * 2 * 3 * c.moe_intermediate_size * c.hidden_size * 2


# --- FP8 (the published block format, weights kept e4m3 on the GPU path) ---------------------------

def _fp8_bytes(parts, k: int, block=(128, 128)) -> int:
    """A fused fp8 projection over `parts` (row counts, each its own checkpoint tensor with its own
    scale grid) of K columns: e4m3 values, fp32 scales, the int32 scale-row map."""
    bn, bk = block
    return sum(n * k + 4 * (-(-n // bn)) * (-(-k // bk)) + 4 * n for n in parts)


def expected_bytes_fp8(c, n: int) -> int:
    """expected_bytes with every projection but the published bf16 ones (lm_head, router and
    shared-expert gate, GDN b / a: fp8.PUBLISHED_NOT_CONVERT) read as e4m3 + scales + row map."""
    bf, H = 2, c.hidden_size
    total = H * bf + c.vocab_size * H * bf  # embedding row, lm_head (bf16)
    for i, kind in enumerate(c.layer_types):
        if kind == "linear_attention":
            nv = c.linear_num_value_heads
            conv_state, rec_state = c.conv_dim * (c.conv_kernel - 1) * bf, nv * c.linear_key_head_dim * \
                c.linear_value_head_dim * 4
            parts = [c.conv_dim, c.value_dim] if c.family != "qwen3_next" else [c.conv_dim + c.value_dim]
            total += _fp8_bytes(parts, H) + 2 * nv * H * bf  # [qkv | z] fp8, [b | a] the bf16 tail
            total += c.conv_dim * c.conv_kernel * bf + 2 * conv_state + 2 * rec_state
            total += _fp8_bytes([H], c.value_dim)  # out_proj
        else:
            q, kv = 2 * c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            total += _fp8_bytes([q, kv, kv], H) + _fp8_bytes([H], c.num_heads * c.head_dim)
            total += 2 * kv * bf * (1 + n + 1)
        if c.is_moe_layer(i):
            E, I, Is, k = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size, \
                c.num_experts_per_tok
            total += (E + 1) * H * bf  # router + shared-expert gate (bf16)
            gate_up = k * (2 * I * H + 4 * 2 * (-(-I // 128)) * (-(-H // 128))) + 4 * 2 * I
            down = k * (H * I + 4 * (-(-H // 128)) * (-(-I // 128))) + 4 * H
            total += gate_up + down + _fp8_bytes([Is, Is], H) + _fp8_bytes([H], Is)
        else:
            total += _fp8_bytes([c.intermediate_size] * 2, H) + _fp8_bytes([H], c.intermediate_size)
    return total


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_fp8_step_bytes_count_what_is_read(ckpt_factory, arch, tmp_path):
    """An FP8 checkpoint as published, on the fp8 path: the step reads e4m3 weights, their scales and
    row maps, and the bf16 tensors in bf16; nothing is counted twice (the eager views of the fused
    weights are the same memory)."""
    from nexrt_vllm.engine.fp8 import PUBLISHED_NOT_CONVERT
    from nexrt_vllm.testing import make_fp8_checkpoint
    torch.set_num_threads(1)
    path = make_fp8_checkpoint(ckpt_factory(arch, "bfloat16"), str(tmp_path / "fp8"), block=128,
                               not_convert=PUBLISHED_NOT_CONVERT)
    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=128, progress=False,
                                 fp8_weights="keep")
    dec = FusedDecoder(eng.model, eng.state)
    for n in (0, 100):
        got = bytes_per_step(dec, n)
        assert got["total"] == expected_bytes_fp8(eng.config, n), (n, got)
    bf16 = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=128, progress=False,
                                  fp8_weights="dequantize")
    assert bytes_per_step(FusedDecoder(bf16.model, bf16.state), 100)["total"] == expected_bytes(bf16.config, 100)


@pytest.mark.parametrize("shape", ["2b", "35b"])
def test_fp8_step_bytes_at_the_benchmarked_shapes(shape):
    """decode_bench --dtype fp8 at the real shapes (meta device): its quantization, its byte count; the
    weight bytes are 0.51-0.52 of bf16's."""
    from nexrt_vllm.bench.shapes import SHAPES
    from nexrt_vllm.bench.step import fp8_weights
    from nexrt_vllm.engine import ModelConfig
    from nexrt_vllm.engine.model import Model
    from nexrt_vllm.engine.weights import expected_shapes

    cfg, n = ModelConfig.from_dict(SHAPES[shape]), 8192
    weights = {k: torch.empty(v, dtype=torch.bfloat16, device="meta") for k, v in expected_shapes(cfg).items()}
    dec = FusedDecoder(Model(cfg, fp8_weights(weights, cfg), n + 1), DecodeState(cfg, n + 1, torch.bfloat16, "meta"))
    got = bytes_per_step(dec, n)
    assert got["total"] == expected_bytes_fp8(cfg, n)
    bf = {k: torch.empty(v, dtype=torch.bfloat16, device="meta") for k, v in expected_shapes(cfg).items()}
    ref = bytes_per_step(FusedDecoder(Model(cfg, bf, n + 1), DecodeState(cfg, n + 1, torch.bfloat16, "meta")), n)
    for g in ("attn_qkv_proj", "gdn_out_proj", "moe_experts" if cfg.num_experts else "mlp_down"):
        assert 0.5 < got[g] / ref[g] < 0.52, (g, got[g] / ref[g])


def test_fp8_vs_bf16_comparison_pairs_shape_and_context():
    from benchmarks.decode_bench import compare_dtypes

    def run(dtype, rows):
        return {"shape": "Qwen3.5-2B", "dtype": dtype, "contexts": [
            {"context": c, "tok_s": t, "mbu": m, "bytes_per_token": b} for c, t, m, b in rows]}
    shapes = [run("bf16", [(1024, 700.0, 0.66, 3.8e9), (8192, 720.0, 0.667, 3.9e9)]),
              run("fp8", [(8192, 936.0, 0.62, 2.5e9)]),
              {"shape": "Qwen3.5-35B-A3B", "dtype": "bf16", "contexts": [{"context": 8192, "tok_s": 1.0, "mbu": 0.6,
                                                                         "bytes_per_token": 6e9}]}]
    (c,) = compare_dtypes(shapes)  # only the (shape, context) run in both formats
    assert (c["shape"], c["context"]) == ("Qwen3.5-2B", 8192)
    assert c["tok_s_ratio"] == 936.0 / 720.0 and abs(c["mbu_points"] - (62.0 - 66.7)) < 1e-9
    assert c["bytes_ratio"] == 2.5e9 / 3.9e9
