"""The graph path at TP > 1 (gpu/tp.py) on CPU: the sharded fused step through the Triton interpreter.

TP = 2 is two processes over gloo (engine/tp.py Group: this process is rank 0, rank 1 follows its
announced replays); on the trained tiny checkpoints of the three families its greedy tokens equal the
TP = 1 fused step's token for token (and the trained period), and each rank's state is its shard of
TP = 1's. Sampling with logprobs (the logit slices all-gathered, rank 0's choice broadcast) gives
TP = 1's tokens; a request closed early, one ended by a stop id, and a later request leave both ranks
in step, over gloo and over the one-shot collectives on peer memory. At TP = 1 with identity collectives
the sharded step is the fused step, bit for bit.
What a CUDA graph adds (capture, NCCL inside it) is checked on GPUs (test_tp_graph_cuda.py).
"""
import os
import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from nexrt_vllm.engine import Engine, SamplingParams, kernels
from nexrt_vllm.engine.gpu.decoder import FusedDecoder
from nexrt_vllm.engine.gpu.runner import GraphRunner
from nexrt_vllm.engine.gpu.tp import Collectives, Follower, Lockstep, TPDecoder
from nexrt_vllm.engine.gpu.tuning import Tuning
from nexrt_vllm.engine.tp import Group
from nexrt_vllm.node import reshard as R
from nexrt_vllm.testing.connector_harness import TRAINED, TRAINED_MTP, period_continuation, periodic_prompt

kernels.load(interpret=True)
torch.set_num_threads(1)

CPU_TUNING = Tuning(gemv=((1 << 62, 64, 128, 4),), lm=(128, 256, 4), attn_splits=4, attn_block=32, gdn_block_v=64,
                    moe=(64, 128, 1), moe_down=(64, 64, 1))
RECIPES = {"qwen3_next": TRAINED, "qwen3_5": TRAINED_MTP["qwen3_5"], "qwen3_5_moe": TRAINED_MTP["qwen3_5_moe"]}
N = 5  # max_tokens: the first token and four graph steps
PROMPT = periodic_prompt(40, seed=1)


class _Launch:
    def __init__(self, d, key):
        self.d, self.key = d, key

    def replay(self):
        self.d.launch(*self.key)


class _DirectRunner(GraphRunner):
    """TP = 1's graph runner on CPU: a replay is the step's launches, run at once."""

    def __init__(self, d):
        super().__init__(d)
        self.graphs = {k: _Launch(d, k) for k in self.VARIANTS}

    def _sync(self):
        pass


class _One(Collectives):
    """The collectives of a group of one rank."""

    def __init__(self):
        super().__init__(1, 0)

    def all_reduce(self, t):
        pass

    max_reduce = broadcast = all_reduce

    def all_gather(self, out, part):
        out.copy_(part)


@pytest.fixture(scope="module")
def group():
    g = Group(2, timeout=600)
    yield g
    g.close()


@pytest.fixture(scope="module")
def tp1(ckpt_factory):
    """arch -> (checkpoint, TP = 1 engine on the fused step's CPU runner)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            path = ckpt_factory(arch, "bfloat16", **RECIPES[arch])
            eng = Engine.from_pretrained(path, dtype=torch.bfloat16, max_seq_len=96, progress=False)
            eng.graph = _DirectRunner(FusedDecoder(eng.model, eng.state, tuning=CPU_TUNING))
            cache[arch] = path, eng
        return cache[arch]

    return get


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


class _CountingStep:
    """A follower's decoder as the lock step sees it: a CPU state, a token, its launches recorded, and
    collectives whose waits are counted (checked after each run)."""

    def __init__(self):
        self.state = SimpleNamespace(device=torch.device("cpu"), position=torch.zeros(1, dtype=torch.int64), seq_len=0)
        self.tok = torch.zeros(1, dtype=torch.int64)
        self.launches = []
        self.checks = 0
        self.coll = SimpleNamespace(check=self._check)

    def _check(self):
        self.checks += 1

    def launch(self, *key):
        self.launches.append((key, int(self.tok), int(self.state.position)))
        time.sleep(0.001 * (len(self.launches) % 3))


def test_lockstep_follower_replays_exactly_what_rank_0_announced():
    """Runs of 3, 0 (never announced), 1 and 5 replays, rank 0 one replay ahead of the follower (its
    replay k completes only with the follower's, as a collective does) and starting each run as soon
    as the last ended: the follower replays each run's variant exactly as often, from its token and
    position, and its state counts them."""
    words, commands, step = [0, 0], queue.Queue(), _CountingStep()
    lock = Lockstep(words, lambda ranks, *cmd: commands.put(cmd))
    runs = [(3, (False, False, False)), (0, (True, False, False)), (1, (True, True, False)), (5, (False, True, True))]

    def rank0():
        for i, (n, key) in enumerate(runs):
            lock.prepare((1,), key, 100 + i, 10 * i)
            for _ in range(n):
                lock.announce()
                while len(step.launches) < int(words[0]) - 1:  # one replay in flight
                    time.sleep(0)
            while len(step.launches) < int(words[0]):  # the run's last replay completes
                time.sleep(0)
            lock.end()
        commands.put(("stop",))

    t = threading.Thread(target=rank0)
    t.start()
    f, done = Follower(step), []
    while (cmd := commands.get(timeout=30))[0] == "run":
        done.append(f.follow(words, *cmd[1:], alive=lambda: True))
        assert step.state.seq_len == cmd[5] + done[-1]
    t.join(30)
    assert done == [n for n, _ in runs if n] and step.checks == len(done)  # the collectives checked after each run
    # (the counting step leaves token and position as the run set them)
    assert step.launches == [(key, 100 + i, 10 * i) for i, (n, key) in enumerate(runs) for _ in range(n)]


def test_tp1_decoder_is_the_fused_step(tp1):
    """One rank, identity collectives: partial store + reduce + residual add, and the greedy key,
    round exactly as the one-device epilogues; the launches are the fused step's plus one reduction
    after each mixer and each FFN."""
    _, eng = tp1("qwen3_5_moe")
    first = int(eng.prefill(PROMPT).argmax())
    n0, snap = eng.export_state()
    one = eng.graph.d
    sharded = TPDecoder(eng.model, eng.state, _One(), tuning=CPU_TUNING)
    plan, base = [s.group for s in sharded.plan()], [s.group for s in one.plan()]
    assert [g for g in plan if g != "tp_allreduce+residual"] == base
    assert plan.count("tp_allreduce+residual") == 2 * len(eng.config.layer_types)
    assert all(plan[j - 1] in ("gdn_out_proj", "attn_o_proj", "moe_experts", "mlp_down")
               for j, g in enumerate(plan) if g == "tp_allreduce+residual")
    for key in ((False, False, False), (True, True, False)):
        out = []
        for d in (one, sharded):
            eng.import_state(n0, snap)
            d.tok.fill_(first)
            d.params.copy_(torch.tensor([0.8, 0.9, 0.0]))
            d.seed.fill_(7)
            d.lp_k.fill_(3)
            toks = []
            for _ in range(3):
                d.launch(*key)
                toks.append(int(d.tok))
            out.append((toks, d.res.clone(), eng.export_state()[1], d.mem.host["lpv"].clone()))
        assert out[0][0] == out[1][0] and torch.equal(out[0][1], out[1][1]), key
        assert all(torch.equal(t, out[1][2][name]) for name, t in out[0][2].items()), key
        assert torch.equal(out[0][3], out[1][3]), key


@pytest.mark.parametrize("arch", list(RECIPES))
def test_tp2_greedy_equals_tp1_fused_step(group, tp1, arch):
    """From TP = 1's prefill state re-sharded (a hand-off), the TP = 2 graph path's greedy tokens are
    TP = 1's fused step's, and each rank's state is its shard of TP = 1's as closely as the eager TP = 2
    engine's is (both differ from TP = 1 by bf16 roundings of partial sums taken in another order,
    which the GDN gates amplify); after an eager TP = 2 prefill the tokens are the same too."""
    path, one = tp1(arch)
    first = int(one.prefill(PROMPT).argmax())
    n0, snap = one.export_state()
    sp = SamplingParams(max_tokens=N, ignore_eos=True)
    want = [first, *one.stream(first, sp)]
    assert want == period_continuation(PROMPT, N)
    _, fused1 = one.export_state()
    one.import_state(n0, snap)
    for t in want[:-1]:
        one.decode_step(t)
    n1, eager1 = one.export_state()

    eng = group.engine(2, path=path, dtype=torch.bfloat16, max_seq_len=96)
    eng.use_graph("fused", tuning=CPU_TUNING, interpret=True)
    assert eng.graph.d.n_part == 2 and not eng.graph.masks  # lm_head rows 192 = 2 programs of 128
    shards = R.node_shards(one.config, 2)
    eng.import_shards(n0, R.split_state(one.config, snap, shards))
    assert list(eng.stream(first, sp)) == want[1:]
    assert eng.finish_reason == "length" and eng.graph.replays == N - 1
    n, graph2 = eng.export_shards()
    eng.import_shards(n0, R.split_state(one.config, snap, shards))
    for t in want[:-1]:
        eng.decode_step(t)
    _, eager2 = eng.export_shards()
    assert n == n1 == len(PROMPT) + N - 1

    def worst(ranks, full):
        return max(_rel(mine[name], exp[name]) for mine, exp in zip(ranks, R.split_state(one.config, full, shards))
                   for name in exp)

    assert sorted(graph2[0]) == sorted(eager2[0]) and sorted(graph2[1]) == sorted(eager2[1])
    assert worst(graph2, fused1) <= 2 * worst(eager2, eager1) + 1e-3

    assert int(eng.prefill(PROMPT).argmax()) == first
    assert list(eng.stream(first, sp)) == want[1:]


@pytest.mark.parametrize("collectives", ["group", "peer"])
def test_tp2_sampling_early_close_and_stops_stay_in_step(group, tp1, collectives):
    """Over gloo and over the one-shot peer kernels (named shared memory between the two processes): the
    greedy key's max, the residual sums, the logit gather and rank 0's token broadcast."""
    path, one = tp1("qwen3_5_moe")
    eng = group.engine(2, path=path, dtype=torch.bfloat16, max_seq_len=96)
    shm = set(os.listdir("/dev/shm"))
    eng.use_graph("fused", tuning=CPU_TUNING, interpret=True, collectives=collectives)
    assert type(eng.graph.d.coll).__name__ == {"group": "Collectives", "peer": "PeerCollectives"}[collectives]
    assert set(os.listdir("/dev/shm")) <= shm  # the named buffers are unlinked once every rank mapped them

    sp = SamplingParams(max_tokens=N, ignore_eos=True, temperature=0.8, seed=3, logprobs=2)
    first = int(one.prefill(PROMPT).argmax())
    want = list(one.steps(first, sp))
    assert int(eng.prefill(PROMPT).argmax()) == first
    got = list(eng.steps(first, sp))
    assert [s.token for s in got] == [s.token for s in want]
    for a, b in zip(got, want):
        assert abs(a.logprob - b.logprob) < 2e-2 and [i for i, _ in a.top] == [i for i, _ in b.top]

    # the consumer stops after two tokens: rank 1 replays exactly what rank 0 announced
    greedy = SamplingParams(max_tokens=N, ignore_eos=True)
    eng.prefill(PROMPT)
    it = eng.stream(first, greedy)
    two = [next(it), next(it)]
    it.close()
    n, shards = eng.export_shards()  # both ranks hold the same number of positions
    assert n == len(PROMPT) + 3 and two == period_continuation(PROMPT, 3)[1:]
    # a stop id: the replay that ran past it is discarded on both ranks
    eng.prefill(PROMPT)
    stop = period_continuation(PROMPT, 3)[2]
    assert list(eng.stream(first, SamplingParams(max_tokens=N, ignore_eos=True, stop_token_ids=(stop,)))) == two
    n, _ = eng.export_shards()
    assert n == len(PROMPT) + 3
    # and the next request still equals TP = 1
    one.prefill(PROMPT)
    assert int(eng.prefill(PROMPT).argmax()) == first
    assert list(eng.stream(first, greedy)) == list(one.stream(first, greedy))
    if collectives == "peer":
        assert int(eng.graph.d.coll.mem.status) == 0
