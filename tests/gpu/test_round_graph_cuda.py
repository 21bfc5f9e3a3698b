"""The captured one-request MTP round on a CUDA GPU with its commit on a second stream beside the draft chain
(Tuning.commit_aside: a branch of the round graph, joined at the round's end): greedy tokens equal the eager
one-token loop's on trained tiny checkpoints with trained MTP heads, and the drafts are accepted (rounds of more
than one token), so a commit that raced the next round's verify or a draft reading a half-committed state would
show as a different token. Marked `gpu` (skipped without a CUDA GPU); on the CPU the round runs its launches in
order whatever the knob says (tests/gpu/test_fused_speculative.py)."""
import pytest

from nexrt_vllm.engine import Engine, SamplingParams
from nexrt_vllm.engine.gpu.tuning import Tuning
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, periodic_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]
N = 128  # tokens per stream


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_round_with_the_commit_aside_equals_eager(ckpt_factory, arch):
    path = ckpt_factory(arch, "bfloat16", **TRAINED_MTP[arch])
    prompt = periodic_prompt(40, seed=21)
    sp = SamplingParams(max_tokens=N, ignore_eos=True)
    ref = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", max_seq_len=256, progress=False)
    first = int(ref.prefill(prompt).argmax())
    want = list(ref.stream(first, sp))
    del ref
    eng = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", max_seq_len=256, progress=False)
    eng.enable_speculative("mtp", 3)
    eng.use_graph("fused", tuning=Tuning(commit_aside=True))
    assert eng.spec_graph is not None and eng.spec_graph.d.aside is not None
    eng.prefill(prompt)
    eng.speculative.rounds = [0] * 5
    assert list(eng.stream(first, sp)) == want
    rounds = eng.speculative.rounds
    assert sum(k * c for k, c in enumerate(rounds)) > 1.5 * sum(rounds), rounds  # drafts accepted
