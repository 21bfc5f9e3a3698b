"""FP8 KV cache (vLLM --kv-cache-dtype fp8): NexRT refuses it, at hello (the node's layout check, whole
and per TP part) and at router start (the connector's probe reports kv_cache_dtype). Its pages hold
x / k_scale (v_scale) with per-layer scales the layout does not carry, so a node decoding them as
plain values would be wrong; the refusal names kv_cache_dtype and says what to change."""
import pytest

from nexrt_vllm.engine import ModelConfig
from nexrt_vllm.handoff import layout as L
from nexrt_vllm.handoff import protocol as P
from nexrt_vllm.handoff.sharding import Sharding
from nexrt_vllm.node.parts import check_part
from nexrt_vllm.router.config_check import mismatches
from nexrt_vllm.testing.senders import layout_for
from nexrt_vllm.testing.tp_sender import layout_for_part


@pytest.fixture(scope="module")
def cfg(qwen3_next_ckpt):
    return ModelConfig.from_pretrained(qwen3_next_ckpt)


def test_fp8_kv_pages_refused_naming_kv_cache_dtype(cfg):
    L.check_layout(layout_for(cfg), cfg)  # the bf16 pages of the same model: taken
    for dt in ("float8_e4m3fn", "uint8"):  # vLLM's fp8 (e4m3) cache; its fp8_e5m2 pages travel as bytes
        with pytest.raises(P.ProtocolError) as ei:
            L.check_layout(layout_for(cfg, kv_dtype=dt), cfg)
        e = ei.value
        assert e.reason is P.Reason.LAYOUT_MISMATCH
        assert f"KV cache pages in {dt}" in e.message and "kv_cache_dtype" in e.message
        assert "--kv-cache-dtype auto" in e.message


def test_quantized_gdn_state_refused(cfg):
    with pytest.raises(P.ProtocolError, match="GDN recurrent state pages in int8 \\(vLLM mamba_cache_dtype\\)"):
        L.check_layout(layout_for(cfg, rec_dtype="int8"), cfg)


def test_fp8_kv_refused_for_a_tp_part(cfg):
    part = Sharding(2, 0, (0, 1), (0, 1), (0, 2))
    check_part(layout_for_part(cfg, part), cfg)
    with pytest.raises(P.ProtocolError) as ei:
        check_part(layout_for_part(cfg, part, kv_dtype="float8_e4m3fn"), cfg)
    assert ei.value.reason is P.Reason.LAYOUT_MISMATCH and "kv_cache_dtype" in ei.value.message


@pytest.mark.parametrize("kv,refused", [("auto", False), ("bfloat16", False), ("fp8", True), ("fp8_e4m3", True),
                                        ("fp8_e5m2", True)])
def test_router_finds_a_quantized_kv_cache_at_start(kv, refused):
    caps = {"dtype": "bfloat16", "transport": {"backend": "nixl"}}
    found = mismatches({"transport": "nixl", "dtype": "bfloat16", "kv_cache_dtype": kv}, caps)
    if refused:
        assert len(found) == 1 and found[0].startswith(f"kv_cache_dtype: vLLM keeps its KV cache in {kv}")
        assert "--kv-cache-dtype auto" in found[0]
    else:
        assert found == []
