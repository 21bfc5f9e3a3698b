"""The captured batch step on a CUDA GPU (Engine.use_batch_graph: one graph over B slots, pipelined replays,
the slot ring read by the host) and the decode node that runs it (`nexrt-decode --graph fused --max-batch B`).

Engine: on trained tiny checkpoints of the three families, four slots joining and leaving at
different steps; each request's greedy tokens equal the eager engine's for it alone, and a slot
that is not live keeps its state byte for byte; the same for the batched MTP round graph
(`--speculative mtp --max-batch B`), one slot speculating to its context's end. Node: three requests at once (two greedy on the
batch step, one seeded sampled on its slot's eager loop) equal the same requests sent one at a time
to the same node, and the greedy ones the CPU engine's continuation; 0 busy slots after. Marked
`gpu` (skipped without a CUDA GPU); the CPU interpreter runs the same launches:
tests/gpu/test_fused_batch_step.py, tests/node/test_batch_graph_jobs.py."""
import json
import threading

import pytest
import torch

from nexrt_vllm.engine import Engine, SamplingParams
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, periodic_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]
N = 48  # tokens per request


def _states(eng) -> list[torch.Tensor]:
    return [t.clone() for t in eng.state.buffers()] + [eng.state.position.clone()]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_captured_batch_step_equals_each_request_alone(ckpt_factory, arch):
    path = ckpt_factory(arch, "bfloat16", **TRAINED_MTP[arch])
    ref = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", max_seq_len=256, progress=False)
    prompts = [periodic_prompt(n, seed=s) for n, s in ((40, 61), (17, 62), (70, 63), (29, 64))]
    lengths = [N, N // 2, N, N]
    firsts, want = [], []
    for p, n in zip(prompts, lengths):
        firsts.append(int(ref.prefill(p).argmax()))
        want.append(list(ref.stream(firsts[-1], SamplingParams(max_tokens=n + 1, ignore_eos=True))))
    del ref
    eng = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", max_seq_len=256, progress=False)
    eng.use_batch_graph(4)
    runner, engines = eng.batch_graph, eng.slots(4)
    assert runner.graph is not None and sorted(runner.graphs) == runner.buckets == [2, 4]
    for e, p in zip(engines, prompts):
        e.prefill(p)
    got = {b: [] for b in range(4)}
    ended = {}

    def steps(n):
        for _ in range(n):
            for ev in runner.step():
                got[ev.slot].append(ev.token)
                if ev.finish_reason:
                    ended[ev.slot] = ev.finish_reason

    for b in (0, 1):
        assert runner.join(b, firsts[b], SamplingParams(max_tokens=lengths[b] + 1, ignore_eos=True)) is None
    steps(5)
    assert runner.join(2, firsts[2], SamplingParams(max_tokens=lengths[2] + 1, ignore_eos=True)) is None
    idle = _states(engines[3])
    steps(10)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(idle, _states(engines[3])))  # not live: untouched
    assert runner.join(3, firsts[3], SamplingParams(max_tokens=lengths[3] + 1, ignore_eos=True)) is None
    while runner.busy:
        steps(1)
    for b in range(4):
        assert got[b] == want[b], (arch, b, next(i for i, (x, y) in enumerate(zip(got[b], want[b])) if x != y))
        assert ended[b] == "length"
    # a request alone on the batch step: the same tokens (the step's rows do not depend on each other)
    engines[1].prefill(prompts[0])
    assert list(runner.generate(1, firsts[0], SamplingParams(max_tokens=N + 1, ignore_eos=True))) == want[0]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_captured_batched_round_equals_each_request_alone(ckpt_factory, arch):
    """The batched MTP round graph (engine/gpu/batch_round.py, 4 slots x M = 4 = 16 verify rows): each
    request's greedy tokens equal the eager one-token loop's alone, slots joining late and one running to
    its context's last position; the trained heads' drafts are accepted (more than one token a round)."""
    L = 160
    path = ckpt_factory(arch, "bfloat16", **TRAINED_MTP[arch])
    ref = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", max_seq_len=L, progress=False)
    prompts = [periodic_prompt(n, seed=s) for n, s in ((40, 71), (17, 72), (70, 73), (29, 74))]
    lengths = [N, N // 2, L - 70, N]  # slot 2: to the context's end
    firsts, want = [], []
    for p, n in zip(prompts, lengths):
        firsts.append(int(ref.prefill(p).argmax()))
        want.append(list(ref.stream(firsts[-1], SamplingParams(max_tokens=n + 1, ignore_eos=True))))
    del ref
    eng = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", max_seq_len=L, progress=False)
    eng.enable_speculative("mtp", 3)
    eng.use_batch_graph(4)
    runner, engines = eng.batch_graph, eng.slots(4)
    assert runner.graph is not None and runner.M == 4 and sorted(runner.graphs) == runner.buckets == [1, 2, 4]
    for e, p in zip(engines, prompts):
        e.prefill(p)
    got, ended = {b: [] for b in range(4)}, {}

    def rounds(n):
        for _ in range(n):
            for ev in runner.step():
                got[ev.slot].append(ev.token)
                if ev.finish_reason:
                    ended[ev.slot] = ev.finish_reason

    for b in (0, 1, 2):
        assert runner.join(b, firsts[b], SamplingParams(max_tokens=lengths[b] + 1, ignore_eos=True)) is None
    idle = _states(engines[3])
    rounds(4)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(idle, _states(engines[3])))  # not live: untouched
    assert runner.join(3, firsts[3], SamplingParams(max_tokens=lengths[3] + 1, ignore_eos=True)) is None
    while runner.busy:
        rounds(1)
    for b in range(4):
        assert got[b] == want[b], (arch, b, next(i for i, (x, y) in enumerate(zip(got[b], want[b])) if x != y))
        assert ended[b] == "length"
    assert engines[2].state.seq_len == L
    assert runner.replays < sum(lengths) / 2 / 1.3, runner.replays  # rounds of more than one token


class _Stream(threading.Thread):
    """One request through the node: prefilled and sent by `side`, its /v1/generate stream read here."""

    def __init__(self, node, side, rid, prompt, max_tokens, **sampling):
        """Handed off here; decoding starts with `start()` (the stream's open)."""
        super().__init__(daemon=True)
        prep = side.prepare(prompt)
        gen = node.admit(rid)["generation"]
        side.send(node, rid, gen, prep)
        self.args = (rid, gen, prep["first"], max_tokens)
        self.node, self.sampling, self.lines, self.error = node, sampling, [], None

    def run(self):
        try:
            with self.node.open_generate(*self.args, timeout=300, **self.sampling) as r:
                self.lines = [json.loads(raw) for raw in r if raw.strip()]
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def tokens(self):
        return [x["token"] for x in self.lines if "token" in x]


NODE_N = 400  # tokens per request through the node: long enough that the three decode together


@pytest.mark.parametrize("speculative", ["off", "mtp"])
def test_node_batch_graph_requests_equal_them_alone(ckpt_factory, speculative):
    from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide

    ckpt = ckpt_factory("qwen3_5", "bfloat16", **TRAINED_MTP["qwen3_5"])
    node = NodeProcess(ckpt, "mooncake", "--device", "cuda", "--graph", "fused", "--max-batch", "3",
                       "--speculative", speculative, max_seq_len=512, start_timeout=900)
    side = PrefillSide(ckpt, "mooncake", max_seq_len=512)
    try:
        caps = node.call("GET", "/capabilities")[1]
        assert caps["max_batch"] == 3 and caps["graph"] == "fused" and caps["tuning"] == {}
        greedy, seeded = dict(ignore_eos=True), dict(ignore_eos=True, temperature=0.8, seed=99)
        reqs = [("g-a", periodic_prompt(33, seed=71), greedy), ("g-b", periodic_prompt(12, seed=72), greedy),
                ("s-c", periodic_prompt(21, seed=73), seeded)]
        alone = {}
        for rid, p, kw in reqs:  # one at a time
            s = _Stream(node, side, rid + "-alone", p, NODE_N, **kw)
            s.start()
            s.join(600)
            assert s.error is None and s.lines[-1]["finish_reason"] == "length", (s.error, s.lines[-1:])
            alone[rid] = s.tokens()
        # all three handed off first, then their streams opened at once (a CPU prefill per hand-off would
        # otherwise let the GPU finish one request before the next arrives)
        streams = [_Stream(node, side, rid, p, NODE_N, **kw) for rid, p, kw in reqs]
        for s in streams:
            s.start()
        for s in streams:
            s.join(600)
            assert s.error is None and s.lines[-1]["finish_reason"] == "length", (s.error, s.lines[-1:])
        for (rid, p, kw), s in zip(reqs, streams):
            assert len(s.tokens()) == NODE_N - 1 and s.tokens() == alone[rid], rid
            if kw is greedy:  # and the CPU engine's own continuation
                first = int(side.engine.prefill(p).argmax())
                want = list(side.engine.stream(first, SamplingParams(max_tokens=NODE_N, **kw)))
                assert s.tokens() == want, rid
        assert node.wait_free()["busy_slots"] == 0
        assert node.metric("nexrt_batch_size_sum") > node.metric("nexrt_batch_size_count")
    finally:
        side.close()
        node.stop()
