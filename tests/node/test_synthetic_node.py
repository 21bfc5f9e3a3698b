"""`nexrt-decode --speculative mtp --speculative-synthetic-acceptance 3.39` (benchmark mode): the node
says so in /capabilities and /metrics, and every verify round of a request emits 3 or 4 tokens (vLLM's
schedule for 3.39 at 3 drafts: 2 or 3 drafts accepted), whatever the drafts are."""
import pytest
import torch

from nexrt_vllm.testing.connector_harness import TRAINED_MTP, periodic_prompt
from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("qwen3_next", "bfloat16", **TRAINED_MTP["qwen3_next"])


def test_pinned_acceptance_is_reported_and_served(ckpt):
    node = NodeProcess(ckpt, "mooncake", "--speculative", "mtp", "--speculative-synthetic-acceptance", "3.39",
                       "--speculative-synthetic-seed", "5", max_seq_len=512)
    side = PrefillSide(ckpt, "mooncake", max_seq_len=512)
    try:
        caps = node.call("GET", "/capabilities")[1]
        assert caps["speculative"]["synthetic_acceptance"] == {"acceptance_length": 3.39, "rates": [1.0, 1.0, 0.39],
                                                               "seed": 5}
        assert node.metric("nexrt_spec_synthetic_acceptance_length") == pytest.approx(3.39)
        prompt = periodic_prompt(60, seed=8)
        prep = side.prepare(prompt)
        adm = node.admit("synthetic")
        side.send(node, "synthetic", adm["generation"], prep)
        tokens, end = node.generate("synthetic", adm["generation"], prep["first"], 121, ignore_eos=True)
        assert len(tokens) == 120 and end["finish_reason"] == "length"
        le = [node.metric("nexrt_spec_acceptance_length_bucket", f'le="{k}.0"') for k in range(1, 5)]
        assert le[0] == le[1] == 0 and le[3] >= 25  # no round emitted 1 or 2 tokens
        assert node.wait_free()["busy_slots"] == 0
    finally:
        side.close()
        node.stop()
