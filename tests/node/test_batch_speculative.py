"""Several requests with MTP speculative decoding on one node (`--max-batch B --speculative mtp`, the
eager round of each slot: CPU or --graph off).

In the decode thread (node/batch.py DecodeBatch) every slot engine has a Speculator of its own, so
each request - greedy, seeded sampling, logprobs - yields exactly the tokens (and logprobs) it
yields alone on a speculating engine, and greedy ones the plain engine's tokens; one batch step
sends a whole round of each; a request cancelled mid-batch leaves the others unchanged and a later
request takes its slot. A real `nexrt-decode --max-batch 4 --speculative mtp` then serves 3
concurrent hand-offs (and one cancelled mid-stream) with each request's own tokens, records the
acceptance of every slot's rounds and frees every slot."""

import pytest
import torch

from nexrt_vllm.engine import Engine, SamplingParams
from nexrt_vllm.node.batch import DecodeBatch
from nexrt_vllm.testing.batch_clients import GenerateStream, JobRequest
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, period_continuation, periodic_prompt
from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide

torch.set_num_threads(1)
SLOTS, MAX_LEN = 4, 128


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("qwen3_5", "bfloat16", **TRAINED_MTP["qwen3_5"])


def _engine(path, speculative=True):
    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=MAX_LEN, progress=False)
    if speculative:
        eng.enable_speculative("mtp", 3)
    return eng


class Metrics:
    """The decode thread's batch-size histogram, as plain lists."""

    class _H:
        def __init__(self):
            self.values = []

        def observe(self, v):
            self.values.append(v)

    class _C:
        def inc(self):
            pass

    def __init__(self):
        self.batch_size, self.step_seconds, self.tokens = self._H(), self._H(), self._C()


def test_each_speculating_request_in_a_batch_equals_it_alone(ckpt):
    ref, plain = _engine(ckpt), _engine(ckpt, speculative=False)
    reqs = [JobRequest("greedy", 0, periodic_prompt(19, seed=61), SamplingParams(max_tokens=40, ignore_eos=True)),
            JobRequest("sampled", 1, periodic_prompt(11, seed=62),
                    SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_k=5, seed=7)),
            JobRequest("logprobs", 2, periodic_prompt(25, seed=63), SamplingParams(max_tokens=20, logprobs=2,
                                                                                ignore_eos=True)),
            JobRequest("cancelled", 3, periodic_prompt(14, seed=64), SamplingParams(max_tokens=60, ignore_eos=True),
                    cancel_after=5)]
    later = JobRequest("later", 3, periodic_prompt(30, seed=65), SamplingParams(max_tokens=30, ignore_eos=True))
    first, want = {}, {}
    for r in reqs + [later]:  # each alone on a speculating engine
        first[r.rid] = int(ref.prefill(r.prompt).argmax())
        want[r.rid] = [(s.token, s.logprob) for s in ref.steps(first[r.rid], r.params)]
    for r in (reqs[0], later):  # greedy speculation is the plain engine's greedy decode
        assert [first[r.rid], *(t for t, _ in want[r.rid])] == \
            plain.generate(r.prompt, r.params.max_tokens, ignore_eos=True) == \
            period_continuation(r.prompt, r.params.max_tokens)

    eng = _engine(ckpt)
    engines = eng.slots(SLOTS)
    specs = [e.speculative for e in engines]
    assert len({id(s) for s in specs}) == SLOTS and len({id(s.drafter.k) for s in specs}) == SLOTS
    assert len({id(s.drafter.w) for s in specs}) == 1  # the head's weights are shared
    metrics = Metrics()
    batch = DecodeBatch(engines, metrics)
    try:
        for r in reqs:
            batch.submit(r.job(first[r.rid]))
        assert reqs[3].released.wait(600)
        batch.submit(later.job(first["later"]))  # slot 3 again, while the others decode
        for r in reqs[:3] + [later]:
            assert r.released.wait(600), r.rid
    finally:
        batch.close()
    for r in reqs[:3] + [later]:
        assert r.end == ("end", "length"), (r.rid, r.end)
        assert r.tokens == [t for t, _ in want[r.rid]], r.rid
    assert reqs[2].logprobs == [lp for _, lp in want["logprobs"]]
    c = reqs[3]
    assert c.end == ("end", "cancelled") and 5 <= len(c.tokens) < 59
    assert c.tokens == [t for t, _ in want["cancelled"]][:len(c.tokens)]
    # every slot ran verify rounds of its own, several of them accepting drafts
    for s in specs:
        assert sum(s.rounds) > 0 and sum(k * n for k, n in enumerate(s.rounds)) > 1.5 * sum(s.rounds)
        assert s.buffered == 0
    # requests were stepped together, a whole round each (more tokens than batch steps)
    assert max(metrics.batch_size.values) >= 3
    sent = sum(len(r.tokens) for r in reqs + [later])
    assert sum(metrics.batch_size.values) < sent


@pytest.fixture(scope="module")
def node(ckpt):
    n = NodeProcess(ckpt, "mooncake", "--max-batch", str(SLOTS), "--speculative", "mtp",
                    "--num-speculative-tokens", "3", max_seq_len=512)
    yield n
    assert n.wait_free()["busy_slots"] == 0
    n.stop()


@pytest.fixture(scope="module")
def side(ckpt):
    s = PrefillSide(ckpt, "mooncake", max_seq_len=512)
    yield s
    s.close()


def test_node_serves_concurrent_speculating_requests(node, side):
    caps = node.call("GET", "/capabilities")[1]
    assert caps["max_batch"] == SLOTS and caps["speculative"]["num_speculative_tokens"] == 3
    rounds0, emitted0 = node.metric("nexrt_spec_acceptance_length_count"), node.metric("nexrt_spec_acceptance_length_sum")
    prompts = {f"s-{i}": periodic_prompt(20 + 7 * i, seed=70 + i) for i in range(4)}
    lengths = {"s-0": 80, "s-1": 50, "s-2": 65, "s-3": 400}
    streams = {}
    for rid, prompt in prompts.items():
        prep = side.prepare(prompt)
        adm = node.admit(rid)
        side.send(node, rid, adm["generation"], prep)
        streams[rid] = (prep["first"], GenerateStream(node, rid, adm["generation"], prep["first"], lengths[rid],
                                                      ignore_eos=True, cancel_after=6 if rid == "s-3" else None,
                                                      timeout=300))
        streams[rid][1].start()
    streams["s-0"][1].wait_tokens(2, timeout=120)
    h = node.health()
    assert h["busy_slots"] >= 2 and h["max_batch"] == SLOTS
    for rid, (first, s) in streams.items():
        s.join(300)
        assert s.error is None, (rid, s.error)
        if rid == "s-3":
            assert s.lines[-1]["finish_reason"] == "cancelled" and 6 <= len(s.tokens()) < 399
            assert [first, *s.tokens()] == period_continuation(prompts[rid], 400)[:len(s.tokens()) + 1]
        else:
            assert s.lines[-1]["finish_reason"] == "length"
            assert [first, *s.tokens()] == period_continuation(prompts[rid], lengths[rid]), rid
    assert node.wait_free()["busy_slots"] == 0
    rounds = node.metric("nexrt_spec_acceptance_length_count") - rounds0
    emitted = node.metric("nexrt_spec_acceptance_length_sum") - emitted0
    assert rounds > 0 and emitted / rounds > 1.5
    assert node.metric("nexrt_batch_size_sum") > node.metric("nexrt_batch_size_count") > 0
    # the slots are free again: a request after the batch decodes as alone
    prompt = periodic_prompt(33, seed=79)
    prep = side.prepare(prompt)
    adm = node.admit("s-after")
    side.send(node, "s-after", adm["generation"], prep)
    tokens, end = node.generate("s-after", adm["generation"], prep["first"], 30, ignore_eos=True)
    assert [prep["first"], *tokens] == period_continuation(prompt, 30) and end["finish_reason"] == "length"
    assert node.wait_free()["busy_slots"] == 0
