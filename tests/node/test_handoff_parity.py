"""Two-process hand-off over each transport: this process plays the prefill side (engine prefill,
vLLM-like scattered pages, the connector's HandoffSender), a real `nexrt-decode` process decodes;
the streamed tokens equal a local Engine.generate of the same prompt (greedy, 48 tokens)."""
import random

import pytest

from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide

CASES = [  # (transport, arch, sender layout): each layout variant is lossless, so tokens must match
    ("mooncake", "qwen3_next", {}),
    ("mooncake", "qwen3_5_moe", {"conv_layout": "DS", "rec_layout": "HKV", "kv_format": "cpu_vec"}),
    ("nixl", "qwen3_next", {"conv_layout": "DS", "kv_format": "cpu_vec"}),
    ("nixl", "qwen3_5_moe", {"rec_layout": "HKV", "kv_dtype": "float32"}),
]
N_TOKENS = 48


@pytest.mark.parametrize("transport,arch,layout", CASES, ids=[f"{t}-{a}" for t, a, _ in CASES])
def test_streamed_tokens_equal_local_generate(ckpt_factory, transport, arch, layout):
    model = ckpt_factory(arch)
    node = NodeProcess(model, transport)
    side = PrefillSide(model, transport, **layout)
    try:
        rng = random.Random(7)
        prompt = [rng.randrange(3, side.engine.config.vocab_size) for _ in range(45)]  # 3 pages, last partial
        ref = side.engine.generate(prompt, N_TOKENS, ignore_eos=True)
        prep = side.prepare(prompt)
        assert prep["first"] == ref[0]
        adm = node.admit("parity-1", prompt_len=len(prompt))
        sent = side.send(node, "parity-1", adm["generation"], prep)
        tokens, final = node.generate("parity-1", adm["generation"], prep["first"], N_TOKENS, ignore_eos=True)
        assert [prep["first"], *tokens] == ref
        assert final["finish_reason"] == "length" and final["timing"]["tokens"] == N_TOKENS - 1
        assert node.metric("nexrt_transfer_bytes_total") == sent.nbytes > 0
        assert node.metric("nexrt_tokens_generated_total") == N_TOKENS - 1
        assert node.metric("nexrt_decode_step_seconds_count") == N_TOKENS - 1
        assert node.metric("nexrt_transfer_seconds_count") == 1 == node.metric("nexrt_admissions_total")
        assert node.wait_free()["busy_slots"] == 0
    finally:
        side.close()
        node.stop()
