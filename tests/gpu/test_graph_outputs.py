"""The graph path's host loop with logprobs and grammar masks (GraphRunner.steps), on CPU.

A CUDA graph cannot run here, so each "replay" is the same step launch (FusedDecoder in eager mode:
the eager model's ops, then the tail and finish kernels through the Triton interpreter) run by a
worker thread standing in for the GPU stream: replays queue up and run while the host loop reads
the ring, so step k+1 really runs while the host computes its mask, and waits at its tail until the
host raises the flag. The tokens, logprobs and top alternatives must equal the eager engine's
(`Engine.steps` without a graph) for the same request.
"""
import concurrent.futures

import pytest
import torch

from nexrt_vllm.engine import Engine, EngineError, SamplingParams, kernels
from nexrt_vllm.engine.gpu.decoder import FusedDecoder
from nexrt_vllm.engine.gpu.runner import GraphRunner
from nexrt_vllm.engine.gpu.tuning import Tuning
from nexrt_vllm.engine.structured import Grammars, apply_mask
from nexrt_vllm.handoff.structured import StructuredSpec

kernels.load(interpret=True)
torch.set_num_threads(1)

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}}, "required": ["n", "tag", "ok"]}


class _Replay:
    def __init__(self, runner, key):
        self.runner, self.key = runner, key

    def replay(self):
        r = self.runner
        r.futures.append(r.worker.submit(r.d.launch, *self.key))


class ThreadRunner(GraphRunner):
    """GraphRunner whose replays run on a worker thread (the 'GPU stream')."""

    def __init__(self, decoder):
        super().__init__(decoder)
        self.worker = concurrent.futures.ThreadPoolExecutor(1)
        self.futures = []
        self.graphs = {k: _Replay(self, k) for k in self.VARIANTS}

    def _sync(self):
        for f in self.futures:
            f.result()


@pytest.fixture(scope="module")
def setup(qwen3_5_ckpt):
    eng = Engine.from_pretrained(qwen3_5_ckpt, device="cpu", dtype="bfloat16", max_seq_len=96, progress=False)
    grammars = Grammars(qwen3_5_ckpt, eng.config.vocab_size)
    logits = eng.prefill([5, 17, 3, 99, 42, 7, 11])
    return eng, grammars, logits, eng.export_state()


def _constraint(grammars, eng, spec):
    return grammars.constraint(grammars.compile(spec), eng.config.eos_token_ids)


def _eager_then_graph(setup, spec, params, spin=1 << 30):
    eng, grammars, logits, (n0, snap) = setup
    c = _constraint(grammars, eng, spec) if spec else None
    first = int(apply_mask(logits, c.fill()).argmax()) if c else int(logits.argmax())
    eng.graph = None
    eng.import_state(n0, snap)
    want = list(eng.steps(first, params, c))
    want_reason = eng.finish_reason
    eng.import_state(n0, snap)
    runner = ThreadRunner(FusedDecoder(eng.model, eng.state, mode="eager",
                                       tuning=Tuning(tail_chunk=128, mask_spin=spin)))
    eng.graph = runner
    try:
        got = list(eng.steps(first, params, _constraint(grammars, eng, spec) if spec else None))
        runner.first = first
        return want, want_reason, got, eng.finish_reason, runner
    finally:
        eng.graph = None


def _same(want, got):
    assert [s.token for s in got] == [s.token for s in want]
    for a, b in zip(want, got):
        assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
        assert [i for i, _ in b.top] == [i for i, _ in a.top]
        assert [v for _, v in b.top] == pytest.approx([v for _, v in a.top], abs=1e-4)


def test_json_schema_with_logprobs_equals_eager(setup):
    want, why, got, why_g, runner = _eager_then_graph(
        setup, StructuredSpec("json_schema", SCHEMA), SamplingParams(max_tokens=40, logprobs=5))
    _same(want, got)
    assert why == why_g == "stop" and want[-1].token in setup[0].config.eos_token_ids  # the grammar ended it
    assert all(len(s.top) <= 5 for s in got) and any(len(s.top) < 5 for s in got)  # forbidden ones not listed
    # one replay per token plus the one that ran past the end (released by the flag, not timed out)
    assert runner.replays == len(got) + 1 and int(runner.d.mask_status) == -1


@pytest.mark.parametrize("spec", [StructuredSpec("regex", "[a-f]{2,5}[0-9]"), StructuredSpec("choice", ["yes", "no"])])
def test_mask_without_logprobs_equals_eager(setup, spec):
    want, why, got, why_g, _ = _eager_then_graph(setup, spec, SamplingParams(max_tokens=12))
    assert [s.token for s in got] == [s.token for s in want] and why == why_g
    assert all(s.logprob is None for s in got)


def test_logprobs_without_mask_equals_eager(setup):
    want, why, got, why_g, _ = _eager_then_graph(setup, None, SamplingParams(max_tokens=6, logprobs=20,
                                                                               ignore_eos=True))
    _same(want, got)
    assert why == why_g == "length" and all(len(s.top) == 20 for s in got)


def test_sampled_masked_tokens_obey_the_grammar(setup):
    """The sampling graph: the mask is stored back before the sort, so every sampled token is allowed."""
    eng, grammars = setup[0], setup[1]
    _, _, got, why, runner = _eager_then_graph(setup, StructuredSpec("regex", "[a-z]{4}"),
                                               SamplingParams(max_tokens=10, temperature=1.5, seed=3))
    toks = [runner.first] + [s.token for s in got]
    assert why == "stop" and toks[-1] in eng.config.eos_token_ids
    text = b"".join(grammars.info.decoded_vocab[t] for t in toks[:-1])
    assert len(text) == 4 and text.isalpha() and text.islower(), text


def test_mask_that_never_comes_is_an_error(setup):
    """A host that does not write the next mask (here: a constraint whose fill is lost) makes the
    step give up after `mask_spin` flag reads; the stream fails instead of emitting an unconstrained
    token."""
    eng, grammars, logits, (n0, snap) = setup
    eng.import_state(n0, snap)
    runner = ThreadRunner(FusedDecoder(eng.model, eng.state, mode="eager", tuning=Tuning(tail_chunk=128, mask_spin=50)))
    runner._publish_mask = lambda constraint, step: None
    c = _constraint(grammars, eng, StructuredSpec("json_object"))
    first = int(apply_mask(logits, c.fill()).argmax())
    eng.graph = runner
    try:
        with pytest.raises(EngineError, match="grammar mask did not arrive"):
            list(eng.steps(first, SamplingParams(max_tokens=5), c))
    finally:
        eng.graph = None


def test_constrained_request_stays_eager_without_mapped_memory(setup):
    """pinned-copy control memory cannot carry masks: such a request runs on the eager loop."""
    eng, grammars, logits, (n0, snap) = setup

    class NoMasks:
        masks = False

        def stream_steps(self, *a):
            raise AssertionError("a constrained request reached the graph")

    eng.import_state(n0, snap)
    c = _constraint(grammars, eng, StructuredSpec("choice", ["alpha", "beta"]))
    first = int(apply_mask(logits, c.fill()).argmax())
    eng.graph = NoMasks()
    try:
        got = list(eng.steps(first, SamplingParams(max_tokens=8), c))
    finally:
        eng.graph = None
    assert eng.finish_reason == "stop" and got


@pytest.mark.parametrize("sample", [False, True])
def test_fused_step_variants_choose_from_the_masked_logits(setup, sample):
    """The fused step (all Triton kernels) with the logprobs + mask variant: the greedy token is the
    argmax of the masked logits the step computed, the sampled one an allowed token, and the
    logprob ring holds log_softmax of the masked logits."""
    from nexrt_vllm.engine.gpu.control import RING

    eng, grammars, logits, (n0, snap) = setup
    eng.import_state(n0, snap)
    tuning = Tuning(gemv=((1 << 62, 64, 128, 4),), lm=(128, 256, 4), attn_splits=4, round_attn_splits=0, attn_block=32,
                    gdn_block_v=64, tail_chunk=128)
    d = FusedDecoder(eng.model, eng.state, mode="fused", tuning=tuning)
    c = _constraint(grammars, eng, StructuredSpec("regex", "[a-z]{2,8}"))
    tok = int(apply_mask(logits, c.fill()).argmax())
    c.accept(tok)
    d.params.copy_(torch.tensor([1.0, 1.0, 0.0]))
    d.lp_k.fill_(4)
    for step in range(2):
        allowed = c.fill()
        want = int(d.step) + 1
        d.mem.host["masks"][want % 2] = allowed
        d.mem.host["flag"].fill_(want)
        d.tok.fill_(tok)
        d.launch(sample, True, True)
        masked = apply_mask(d.logits, allowed)  # (the sampling variant stored these back already)
        ref = torch.log_softmax(masked, -1)
        tok = int(d.tok)
        assert torch.isfinite(ref[tok]), "a forbidden token was chosen"
        if not sample:
            assert tok == int(masked.argmax())
        slot = (want - 1) % RING
        assert int(d.ring[slot]) == (want << 32) | tok
        assert float(d.mem.host["lpv"][slot, 0]) == pytest.approx(float(ref[tok]), abs=1e-5)
        ids = torch.sort(ref, descending=True, stable=True).indices[:4].tolist()
        assert d.mem.host["lpi"][slot, :4].tolist() == ids
        c.accept(tok)
    assert int(d.mask_status) == -1
