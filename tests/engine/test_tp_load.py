"""A tensor-parallel rank loads only its shard (engine/tp.py `_build`): `load_checkpoint(shard=)` and
`random_weights(shard=)` pass each tensor through `tp.shard_tensor` as they read or make it, before it
moves to the device, and give every rank exactly the tensors that sharding the whole model gives it.

Checked at TP = 2 and 4 on checkpoints of the three families (the MoE one with per-expert tensors, which
the loader stacks after sharding each), a sharded FP8 checkpoint (dequantized, then sharded) and random
weights. The TP engine built this way decodes as TP = 1: tests/engine/test_tp_parity.py.
"""
import pytest
import torch

from nexrt_vllm.engine.config import ModelConfig
from nexrt_vllm.engine.errors import ConfigError
from nexrt_vllm.engine.tp import shard_tensor, shard_weights
from nexrt_vllm.engine.weights import load_checkpoint, random_weights
from nexrt_vllm.testing import TP_SHAPES, make_fp8_checkpoint

torch.set_num_threads(1)
SHAPES = TP_SHAPES


def same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def loads_each_rank_its_shard(path: str, cfg: ModelConfig, dtype) -> set[str]:
    whole, mtp = load_checkpoint(path, cfg, dtype, progress=False)
    seen: set[str] = set()
    for tp in (2, 4):
        for rank in range(tp):
            calls = []

            def mine(name, w, tp=tp, rank=rank):
                calls.append(name)
                assert w.device.type == "cpu"  # read on the host, sharded before it moves
                return shard_tensor(cfg, name, w, tp, rank)

            got, got_mtp = load_checkpoint(path, cfg, dtype, progress=False, shard=mine)
            same(got, shard_weights(cfg, whole, tp, rank))
            same(got_mtp, mtp)  # the MTP head: whole
            assert len(calls) == len(set(calls))  # each tensor once
            seen.update(calls)
    return seen


@pytest.mark.parametrize("arch", list(SHAPES))
def test_each_rank_loads_its_shard(ckpt_factory, arch):
    path = ckpt_factory(arch, "bfloat16", **SHAPES[arch])
    cfg = ModelConfig.from_pretrained(path)
    seen = loads_each_rank_its_shard(path, cfg, torch.bfloat16)
    if arch == "qwen3_5_moe":
        # per-expert tensors were sharded one by one, before the loader stacked them
        assert any(".mlp.experts.0.gate_proj.weight" in n for n in seen)
        assert any(".mlp.experts.0.down_proj.weight" in n for n in seen)


def test_fp8_checkpoint_dequantized_then_sharded(ckpt_factory, tmp_path):
    src = ckpt_factory("qwen3_next", "bfloat16", **SHAPES["qwen3_next"])
    path = make_fp8_checkpoint(src, str(tmp_path / "fp8"), block=16, shards=2)
    cfg = ModelConfig.from_pretrained(path)
    loads_each_rank_its_shard(path, cfg, torch.bfloat16)
    with pytest.raises(ValueError, match="keep_fp8"):
        load_checkpoint(path, cfg, torch.bfloat16, progress=False, keep_fp8=True,
                        shard=lambda n, w: shard_tensor(cfg, n, w, 2, 0))


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_random_weights_sharded_as_made(ckpt_factory, arch):
    cfg = ModelConfig.from_pretrained(ckpt_factory(arch, "bfloat16", **SHAPES[arch]))
    whole = random_weights(cfg, torch.bfloat16, seed=3)
    for rank in range(2):
        got = random_weights(cfg, torch.bfloat16, seed=3, shard=lambda n, w, r=rank: shard_tensor(cfg, n, w, 2, r))
        same(got, shard_weights(cfg, whole, 2, rank))


def test_unknown_tensor_is_refused(ckpt_factory):
    cfg = ModelConfig.from_pretrained(ckpt_factory("qwen3_next", "bfloat16", **SHAPES["qwen3_next"]))
    with pytest.raises(ConfigError, match="no tensor-parallel rule"):
        shard_tensor(cfg, "layers.0.mlp.experts.0.wrong_proj.weight", torch.zeros(4, 4), 2, 0)
