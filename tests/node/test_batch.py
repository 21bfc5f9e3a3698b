"""Several requests on one node (`--max-batch`): a real `nexrt-decode` process with 3 slots, fed by the
engine's own prefill (testing.node_process.PrefillSide).

Requests join and leave between steps: each one's tokens (greedy, seeded sampling, logprobs) equal
the same request alone, byte for byte, however the others start, end or are cancelled; a fourth
admission is refused 409 while three are in flight; 0 busy slots after. Flags the batch does not
support are refused at start."""
import random

import pytest
import torch

from nexrt_vllm.engine import SamplingParams
from nexrt_vllm.node.server import main as node_main
from nexrt_vllm.testing.batch_clients import GenerateStream
from nexrt_vllm.testing.node_process import NodeProcess, PrefillSide

torch.set_num_threads(1)
SLOTS = 3


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def env(request):
    ckpt = request.getfixturevalue(f"{request.param}_ckpt")
    node = NodeProcess(ckpt, "mooncake", "--max-batch", str(SLOTS), max_seq_len=512)
    side = PrefillSide(ckpt, "mooncake", max_seq_len=512)
    yield node, side
    side.close()
    assert node.wait_free()["busy_slots"] == 0
    node.stop()


def _prompt(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, 300) for _ in range(n)]


def _alone(side, prompt, params):
    """The request alone: the prefill engine's own first token and continuation (tokens + logprobs)."""
    eng = side.engine
    first = int(eng.prefill(prompt).argmax())
    return first, [(r.token, r.logprob) for r in eng.steps(first, params)]


def _start(node, side, rid, prompt, max_tokens, **kw):
    prep = side.prepare(prompt)
    adm = node.admit(rid)
    side.send(node, rid, adm["generation"], prep)
    s = GenerateStream(node, rid, adm["generation"], prep["first"], max_tokens, **kw)
    s.start()
    return prep, s


def test_each_request_in_a_batch_equals_it_alone(env):
    node, side = env
    pa, pb, pc, pd = _prompt(1, 37), _prompt(2, 12), _prompt(3, 80), _prompt(4, 25)
    greedy = dict(ignore_eos=True)
    seeded = dict(ignore_eos=True, temperature=0.9, top_p=0.95, seed=1234)
    ref_a = _alone(side, pa, SamplingParams(max_tokens=60, **greedy))
    ref_b = _alone(side, pb, SamplingParams(max_tokens=30, logprobs=3, **greedy))
    ref_c = _alone(side, pc, SamplingParams(max_tokens=45, **seeded))
    ref_d = _alone(side, pd, SamplingParams(max_tokens=20, **greedy))

    # A alone first; B and C join while it decodes; D waits for a free slot (409 until one ends)
    _, a = _start(node, side, "b-a", pa, 60, **greedy)
    a.wait_tokens(4)
    _, b = _start(node, side, "b-b", pb, 30, logprobs=3, **greedy)
    b.wait_tokens(2)
    _, c = _start(node, side, "b-c", pc, 45, **seeded)
    c.wait_tokens(1)
    h = node.health()
    assert h["busy_slots"] == SLOTS and h["status"] == "busy" and h["max_batch"] == SLOTS
    assert sorted(r["slot"] for r in h["requests"]) == list(range(SLOTS))
    status, body = node.call("POST", "/v1/admit", {"rid": "b-d"})
    assert status == 409 and body["error"]["type"] == "busy" and f"all {SLOTS} slots" in body["error"]["message"]
    b.join(120)  # the shortest leaves first; its slot is taken by D while A and C go on
    assert c.is_alive() or len(c.tokens()) == 44
    _, d = _start(node, side, "b-d", pd, 20, **greedy)
    for s in (a, c, d):
        s.join(120)
    for s, (first, want) in ((a, ref_a), (b, ref_b), (c, ref_c), (d, ref_d)):
        assert s.error is None, s.error
        assert s.lines[-1]["finish_reason"] == "length", s.lines[-1]
        assert s.tokens() == [t for t, _ in want], s.rid
    for x, (_, lp) in zip(b.lines[:-1], ref_b[1]):
        assert x["logprob"] == pytest.approx(lp, abs=1e-6)
    assert node.wait_free()["busy_slots"] == 0
    # the requests really were stepped together: some batch step advanced more than one of them
    steps, advanced = node.metric("nexrt_batch_size_count"), node.metric("nexrt_batch_size_sum")
    assert advanced > steps > 0


def test_cancel_mid_batch_leaves_the_others_unchanged(env):
    node, side = env
    pa, pb, pc = _prompt(11, 20), _prompt(12, 33), _prompt(13, 9)
    ref_a = _alone(side, pa, SamplingParams(max_tokens=40, ignore_eos=True))
    ref_c = _alone(side, pc, SamplingParams(max_tokens=40, ignore_eos=True))
    _, a = _start(node, side, "x-a", pa, 40, ignore_eos=True)
    _, b = _start(node, side, "x-b", pb, 400, ignore_eos=True, cancel_after=5)
    _, c = _start(node, side, "x-c", pc, 40, ignore_eos=True)
    for s in (a, b, c):
        s.join(120)
        assert s.error is None, s.error
    assert b.lines[-1]["finish_reason"] == "cancelled" and 5 <= len(b.tokens()) < 399
    assert a.tokens() == [t for t, _ in ref_a[1]] and c.tokens() == [t for t, _ in ref_c[1]]
    assert node.wait_free()["busy_slots"] == 0
    assert node.call("GET", "/capabilities")[1]["max_batch"] == SLOTS
    assert node.metric("nexrt_slots") == SLOTS


@pytest.mark.parametrize("flags,message", [
    (["--max-batch", "9"], "--max-batch must be in [1, 8]"),
    (["--max-batch", "0"], "--max-batch must be in [1, 8]"),
    (["--max-batch", "8", "--speculative", "mtp", "--num-speculative-tokens", "4", "--device", "cuda", "--graph",
      "fused"], "= 40 rows per round, at most 32"),
    (["--max-batch", "5", "--speculative", "mtp", "--num-speculative-tokens", "7", "--device", "cuda"],
     "= 40 rows per round, at most 32"),
    (["--max-batch", "2", "--device", "cuda", "--graph", "eager"], "runs the fused batch step"),
    (["--max-batch", "2", "--tp", "2"], "--max-batch > 1 with --tp > 1 is not built"),
])
def test_unsupported_batch_flags_are_refused_at_start(flags, message, capsys):
    with pytest.raises(SystemExit) as ei:
        node_main(["--model", "/nonexistent", *flags])
    assert ei.value.code == 2 and message in capsys.readouterr().err
