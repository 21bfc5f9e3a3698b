"""The trained tiny checkpoints' recipes and the periodic prompts they continue: no dependency beyond the
standard library, so GPU checks import them on a machine without the connector's stack (pyzmq, vLLM)."""
from __future__ import annotations

import random

# The connector tests' checkpoint (make_checkpoint overrides): every expert always selected, so bf16
# vLLM and the fp32 node never route a token to different experts; trained to continue periodic
# text (testing.train_periodic), so greedy decoding is confident (top-1 margins of several nats)
# and decided by the context: bf16-vs-fp32 noise cannot flip a token, a wrong state does.
TRAINED = {"num_experts": 2, "num_experts_per_tok": 2, "train": "periodic"}
# With a trained MTP head (testing/mtp_head.py), per family: qwen3_next extends TRAINED (its model is
# derived from the same cached one); the MoE family routes 2 of 4 experts, so the head's experts are
# really selected.
TRAINED_MTP = {
    "qwen3_next": {**TRAINED, "mtp": True},
    "qwen3_5": {"train": "periodic", "mtp": True},
    "qwen3_5_moe": {"num_experts": 4, "num_experts_per_tok": 2, "train": "periodic", "mtp": True},
}


def periodic_prompt(n: int, seed: int) -> list[int]:
    """n tokens: a segment of p distinct ordinary tokens repeated (p < n, 3..24), which the trained
    checkpoint continues; different seeds give different segments."""
    rng = random.Random(seed)
    p = rng.randint(3, max(3, min(24, n - 1)))
    seg = rng.sample(range(3, 380), p)
    return [seg[i % p] for i in range(n)]


def period_continuation(prompt: list[int], k: int) -> list[int]:
    """The next k tokens of a periodic_prompt (its period is where its first token recurs)."""
    p = prompt.index(prompt[0], 1)
    return [prompt[(len(prompt) + i) % p] for i in range(k)]
