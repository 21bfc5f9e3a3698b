"""Under vLLM's MultiConnector next to NixlConnector: unclaimed requests generate exactly as in a
vLLM without any connector, a request that both connectors act on gets both sets of
kv_transfer_params without a key clash, and a claimed request still hands off correctly."""
import pytest

from nexrt_vllm.testing.connector_harness import (TRAINED, VLLMProc, assert_vllm_greedy, continue_on_node, hand_off, nexrt_kv_config,
                               periodic_prompt, vllm_with_node)

pytestmark = pytest.mark.timeout(600)

PROMPTS = [periodic_prompt(n, 300 + n) for n in (9, 260, 700)]


def _multi_config():
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    return {"kv_connector": "MultiConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"connectors": [nexrt_kv_config("mooncake"), nixl]}}


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("qwen3_next", "bfloat16", **TRAINED)


@pytest.fixture(scope="module")
def plain_outputs(ckpt, tmp_path_factory):
    v = VLLMProc({"model": ckpt, "max_num_batched_tokens": 512}, str(tmp_path_factory.mktemp("plain") / "vllm.log"))
    try:
        return v.generate([{"prompt_token_ids": p, "max_tokens": 16} for p in PROMPTS])
    finally:
        v.close()


@pytest.fixture(scope="module")
def multi(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("multi")
    yield from vllm_with_node(ckpt, d, "mooncake", _multi_config())


def test_unclaimed_requests_unchanged(multi, plain_outputs):
    vllm, _ = multi
    outs = vllm.generate([{"prompt_token_ids": p, "max_tokens": 16} for p in PROMPTS])
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in plain_outputs]
    assert all(o["kv_transfer_params"] is None for o in outs)


def test_both_connectors_params_no_clash(multi):
    vllm, node = multi
    claim = node.admit("both", 300)
    (out,) = vllm.generate([{"prompt_token_ids": periodic_prompt(300, 7), "max_tokens": 1,
                             "kv_transfer_params": {**claim, "do_remote_decode": True}}])
    params = out["kv_transfer_params"]
    assert params["nexrt"]["rid"] == "both" and params["nexrt"]["status"] == "sending"
    assert "remote_block_ids" in params  # NixlConnector's own keys, side by side with ours
    assert not any(k.startswith("nexrt") for k in params if k != "nexrt")
    node.post("/v1/cancel", {"rid": "both"})


def test_claimed_request_hands_off(multi):
    vllm, node = multi
    prompt = periodic_prompt(600, 8)
    ((claim, out),) = hand_off(vllm, [(node, "multi-claimed", prompt)])
    assert set(out["kv_transfer_params"]) == {"nexrt"}
    full = continue_on_node(node, claim, out, 33)
    assert_vllm_greedy(vllm, prompt, full)
