"""The captured TP step on GPUs (gpu/tp.py): TP = 2, rank r on cuda:r, each rank replaying its own CUDA
graph with NCCL inside. On the stored trained checkpoints its greedy tokens equal the one-GPU graph
path's (and the trained period), its sampled tokens with logprobs equal them for a seed, a request
closed early and one ended by a stop id leave the ranks in step, and `nexrt-decode --tp 2 --device
cuda` captures the graph at start. Marked `gpu`; skipped with fewer than 2 GPUs:

    python -m pytest -m gpu tests/gpu/test_tp_graph_cuda.py
"""
import pytest
import torch

from nexrt_vllm.engine import Engine, SamplingParams
from nexrt_vllm.testing.connector_harness import TRAINED, TRAINED_MTP, period_continuation, periodic_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

RECIPES = {"qwen3_next": TRAINED, "qwen3_5": TRAINED_MTP["qwen3_5"], "qwen3_5_moe": TRAINED_MTP["qwen3_5_moe"]}
N = 48


@pytest.fixture(scope="module")
def group():
    from nexrt_vllm.engine.tp import Group

    g = Group(2, device="cuda", timeout=300)
    yield g
    g.close()


@pytest.mark.parametrize("arch", list(RECIPES))
def test_tp2_graph_equals_one_gpu_graph(group, ckpt_factory, arch):
    path = ckpt_factory(arch, "bfloat16", **RECIPES[arch])
    one = Engine.from_pretrained(path, device="cuda:0", dtype=torch.bfloat16, max_seq_len=256, progress=False)
    one.use_graph("fused")
    eng = group.engine(2, path=path, dtype=torch.bfloat16, max_seq_len=256)
    eng.use_graph("fused")
    assert eng.graph.masks == one.graph.masks
    greedy = SamplingParams(max_tokens=N, ignore_eos=True)
    for seed in (1, 2):
        prompt = periodic_prompt(60, seed=seed)
        first = int(one.prefill(prompt).argmax())
        want = [first, *one.stream(first, greedy)]
        assert want == period_continuation(prompt, N)
        assert int(eng.prefill(prompt).argmax()) == first
        assert [first, *eng.stream(first, greedy)] == want

    sampled = SamplingParams(max_tokens=N, ignore_eos=True, temperature=0.7, seed=11, logprobs=3)
    prompt = periodic_prompt(60, seed=3)
    first = int(one.prefill(prompt).argmax())
    want = list(one.steps(first, sampled))
    eng.prefill(prompt)
    got = list(eng.steps(first, sampled))
    assert [s.token for s in got] == [s.token for s in want]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got, want)) < 5e-2

    eng.prefill(prompt)
    it = eng.stream(first, greedy)
    head = [next(it) for _ in range(5)]
    it.close()
    n, _ = eng.export_shards()  # both ranks hold the same positions
    assert n == len(prompt) + 6
    stop = head[2]
    eng.prefill(prompt)
    got = list(eng.stream(first, SamplingParams(max_tokens=N, ignore_eos=True, stop_token_ids=(stop,))))
    assert got == head[:head.index(stop) + 1]
    one.prefill(prompt)
    eng.prefill(prompt)
    assert list(eng.stream(first, greedy)) == list(one.stream(first, greedy))


def test_tp2_node_captures_the_graph(ckpt_factory):
    from nexrt_vllm.testing.node_process import NodeProcess

    path = ckpt_factory("qwen3_next", "bfloat16", **TRAINED)
    node = NodeProcess(path, "mooncake", "--tp", "2", "--device", "cuda", start_timeout=600)
    try:
        status, caps = node.call("GET", "/capabilities")
        assert status == 200 and caps["graph"] == "fused" and caps["tp"]["size"] == 2
        assert caps["tp"]["backend"] == "nccl" and [r["device"] for r in caps["tp"]["ranks"]] == ["cuda:0", "cuda:1"]
    finally:
        node.stop()
