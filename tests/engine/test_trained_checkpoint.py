"""The trained tiny checkpoint the end-to-end parity tests rely on (testing.make_checkpoint with
train="periodic"): it must continue periodic text with a wide top-1 margin at every position and
length the tests use, in plain and chat-template prompts, else exact-equality tests of bf16 vLLM
against the fp32 node would rest on luck. Shares the session's trained checkpoint (no extra training)."""
import random

import pytest
import torch
import transformers

from nexrt_vllm.testing.connector_harness import TRAINED, period_continuation, periodic_prompt
from nexrt_vllm.engine import Engine
from nexrt_vllm.testing import chat_frame, copy_margins

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trained(ckpt_factory):
    path = ckpt_factory("qwen3_next", "bfloat16", **TRAINED)
    return path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize("n", [5, 40, 300, 1100])
def test_periodic_continuation_is_confident(trained, n):
    _, model = trained
    for seed in range(3):
        prompt = periodic_prompt(n, seed=1000 * n + seed)
        worst = min(copy_margins(model, prompt + period_continuation(prompt, 33), n - 1))
        assert worst > 2.0, f"n={n} seed={seed}: top-1 margin {worst:.2f} nats"


def test_chat_template_continuation_is_confident(trained):
    path, model = trained
    head, foot = chat_frame(path)
    rng = random.Random(5)
    for _ in range(4):
        p = rng.randint(3, 12)
        seg = rng.sample([t for t in range(3, 380) if t not in head + foot], p)
        text = [seg[i % p] for i in range(rng.randint(2 * p, 40))]
        ids = head + text + foot + [seg[i % p] for i in range(33)]
        worst = min(copy_margins(model, ids, len(head) + len(text) + len(foot) - 1))
        assert worst > 0.5, f"chat prompt: top-1 margin {worst:.2f} nats"


def test_engine_greedy_continues_the_period(trained):
    path, _ = trained
    eng = Engine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=512, progress=False)
    prompt = periodic_prompt(40, seed=3)
    toks = [int(torch.argmax(eng.prefill(prompt)))]
    for _ in range(32):
        toks.append(int(torch.argmax(eng.decode_step(toks[-1]))))
    assert toks == period_continuation(prompt, 33)
