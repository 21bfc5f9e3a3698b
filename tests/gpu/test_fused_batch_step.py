"""The batch step (gpu/batch_decoder.py BatchDecoder, gpu/batch_runner.py BatchRunner: B request slots in one
plan of fused Triton launches) against each request alone, on CPU through the Triton interpreter.

Three slots with different prompts and positions, on trained tiny checkpoints of the three families
(confident greedy tokens; Qwen3-Next also quantized as the published FP8 checkpoints, its weights kept e4m3 +
scales, against the eager engine on them, which dequantizes each weight as loading would): each slot's tokens
equal the eager engine's for its request alone and the single-request fused step's (FusedDecoder), token
for token, while the others join late, leave early (max_tokens) or are cancelled mid-stream. A slot that is not live is left byte for byte as
it was (its state, position and token), before it joins and after it left. The slot engines'
states are views of the stacked states: the eager prefill writes the slot the batch step reads.
The graph capture and the pipelined replays on the device: tests/gpu/test_batch_graph.py (gpu)."""
import dataclasses

import pytest
import torch

from nexrt_vllm.engine import Engine, EngineError, SamplingParams, StateError, kernels
from nexrt_vllm.engine.fp8 import PUBLISHED_NOT_CONVERT, FP8Weight
from nexrt_vllm.engine.gpu.batch_decoder import BatchDecoder
from nexrt_vllm.engine.gpu.batch_runner import BatchRunner
from nexrt_vllm.engine.gpu.decoder import FusedDecoder
from nexrt_vllm.engine.gpu.tuning import Tuning
from nexrt_vllm.engine.state import StackedStates
from nexrt_vllm.testing import make_fp8_checkpoint
from nexrt_vllm.testing.connector_harness import TRAINED_MTP, periodic_prompt

kernels.load(interpret=True)

torch.set_num_threads(1)
SLOTS, MAX_LEN = 3, 64
# Few, large programs: the interpreter's cost is per program. The M-row GEMVs on the tensor-core kernel
# (2 stages), as on the H200, except the GDN in_proj + conv and (below Tuning.gated_norm_rows slots) the
# GDN out_proj, on the fold kernel.
CPU_TUNING = Tuning(gemv=((1 << 62, 64, 128, 4),), gemv_rows=((1 << 62, 64, 128, 4, 2),), prefetch=0,
                    gemv_gated_rows=(64, 128, 4, 0),
                    lm=(128, 256, 4), lm_rows=(128, 128, 4, 2), attn_splits=2, attn_block=32, gdn_block_v=64,
                    moe=(64, 128, 1), moe_down=(64, 64, 1), gemv_fp8=((1 << 62, 64, 128, 4),),
                    gemv_rows_fp8=((1 << 62, 64, 128, 4, 2),), gemv_gated_fp8=(64, 128, 4), lm_fp8=(128, 128, 4),
                    moe_fp8=(64, 128, 4), moe_down_fp8=(64, 64, 4))


def alone(eng: Engine, prompt: list[int], n: int) -> tuple[int, list[int], list[int]]:
    """(first token, the eager engine's next n greedy tokens, the fused step's next n tokens) of a request alone."""
    first = int(eng.prefill(prompt).argmax())
    n0, snap = eng.export_state()
    want = list(eng.stream(first, SamplingParams(max_tokens=n + 1, ignore_eos=True)))
    eng.import_state(n0, snap)
    dec = FusedDecoder(eng.model, eng.state, mode="fused", tuning=CPU_TUNING)
    fused = []
    dec.tok.fill_(first)
    for _ in range(n):
        dec.launch()
        fused.append(int(dec.tok))
    return first, want, fused


def snapshot(eng: Engine, runner: BatchRunner, slot: int) -> list[torch.Tensor]:
    d = runner.d
    return [t.clone() for t in eng.state.buffers()] + [d.pos[slot].clone(), d.tok[slot].clone()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# split: the GDN out_proj's norm in a launch of its own (Tuning.gated_norm_rows; 3 slots take the prologue
# by default), and the attention's K/V in other splits than the one-request step's (Tuning.batch_attn_splits)
@pytest.mark.parametrize("arch,split,fmt", [("qwen3_5", False, "bf16"), ("qwen3_5", True, "bf16"),
                                            ("qwen3_5_moe", False, "bf16"), ("qwen3_next", False, "bf16"),
                                            ("qwen3_next", True, "fp8")])
def test_batch_step_equals_each_request_alone(ckpt_factory, tmp_path, arch, split, fmt):
    path = ckpt_factory(arch, "bfloat16", **TRAINED_MTP[arch])
    if fmt == "fp8":
        path = make_fp8_checkpoint(path, str(tmp_path / "fp8"), block=128, not_convert=PUBLISHED_NOT_CONVERT)
    load = dict(device="cpu", dtype="bfloat16", max_seq_len=MAX_LEN, progress=False,
                fp8_weights="keep" if fmt == "fp8" else "auto")
    ref = Engine.from_pretrained(path, **load)
    prompts = [periodic_prompt(n, seed=s) for n, s in ((21, 31), (9, 32), (30, 33))]
    steps = [4, 5, 6]  # tokens per request (slot 0 leaves first)
    refs = [alone(ref, p, n) for p, n in zip(prompts, steps)]
    for first, want, fused in refs:
        assert fused == want, (arch, want, fused)

    eng = Engine.from_pretrained(path, **load)
    states = StackedStates(eng.model.config, SLOTS, MAX_LEN, eng.dtype, eng.device)
    tuning = dataclasses.replace(CPU_TUNING, gated_norm_rows=2, batch_attn_splits=4) if split else \
        dataclasses.replace(CPU_TUNING, gated_norm_rows=8, batch_attn_splits=0)
    runner = BatchRunner(BatchDecoder(eng.model, states, tuning))
    if fmt == "fp8":  # the in_proj (its b / a a bf16 tail), experts, attention read e4m3
        L = runner.d.layers
        assert all(isinstance(w, FP8Weight) for w in (L[0].mixer.w_in, L[0].ffn.gate_up, L[0].ffn.down))
    eng.use_batch(runner)
    engines = eng.slots(SLOTS)
    assert [e.state for e in engines] == states.states and all(e.batch_graph is runner for e in engines)
    for e, p in zip(engines, prompts):
        e.prefill(p)  # the eager prefill writes the stacked state's slot
    got = {b: [] for b in range(SLOTS)}
    ends = {}

    def run(n_steps):
        for _ in range(n_steps):
            for ev in runner.step():
                got[ev.slot].append(ev.token)
                if ev.finish_reason:
                    ends[ev.slot] = (ev.finish_reason, snapshot(engines[ev.slot], runner, ev.slot))

    # slots 0 and 2 start; slot 1 joins two steps later, untouched until then
    for b in (0, 2):
        assert runner.join(b, refs[b][0], SamplingParams(max_tokens=steps[b] + 1, ignore_eos=True)) is None
    idle = snapshot(engines[1], runner, 1)
    run(2)
    assert same(idle, snapshot(engines[1], runner, 1)) and got[1] == []
    assert runner.join(1, refs[1][0], SamplingParams(max_tokens=steps[1] + 1, ignore_eos=True)) is None
    run(6)
    for b in range(SLOTS):
        assert got[b] == refs[b][1], (arch, b, got[b], refs[b][1])
        assert ends[b][0] == "length"
        # after it left, no later step touched the slot
        assert same(ends[b][1], snapshot(engines[b], runner, b)), (arch, b)
        assert engines[b].state.seq_len == len(prompts[b]) + steps[b]
    assert runner.busy == [] and runner.step() == []


def test_cancel_and_stop_leave_the_others_unchanged(ckpt_factory):
    """A request cancelled mid-stream (`leave`) and one that meets a stop id: the other slot's tokens are
    those it has alone; the stopped request ends "stop" with the stop token; a request whose first
    token stops ends before any step; sampled and logprob requests are refused by the batch step."""
    arch = "qwen3_5"
    path = ckpt_factory(arch, "bfloat16", **TRAINED_MTP[arch])
    ref = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=MAX_LEN, progress=False)
    pa, pb = periodic_prompt(17, seed=41), periodic_prompt(12, seed=42)
    fa, want_a, _ = alone(ref, pa, 6)
    fb, want_b, _ = alone(ref, pb, 6)

    eng = Engine.from_pretrained(path, device="cpu", dtype="bfloat16", max_seq_len=MAX_LEN, progress=False)
    runner = BatchRunner(BatchDecoder(eng.model, StackedStates(eng.model.config, 2, MAX_LEN, eng.dtype, eng.device),
                                      CPU_TUNING))
    eng.use_batch(runner)
    a, b = eng.slots(2)
    with pytest.raises(StateError, match="empty"):
        runner.join(0, fa, SamplingParams(max_tokens=5))
    a.prefill(pa)
    b.prefill(pb)
    with pytest.raises(EngineError, match="greedy"):
        runner.join(0, fa, SamplingParams(max_tokens=5, temperature=0.7, seed=1))
    with pytest.raises(EngineError, match="greedy"):
        runner.join(0, fa, SamplingParams(max_tokens=5, logprobs=2))
    assert runner.join(0, fa, SamplingParams(max_tokens=5, stop_token_ids=(fa,))) == "stop"
    assert runner.busy == []
    stop = next(t for t in want_b[2:] if t != fb)
    assert runner.join(0, fa, SamplingParams(max_tokens=50, ignore_eos=True)) is None
    assert runner.join(1, fb, SamplingParams(max_tokens=50, stop_token_ids=(stop,), ignore_eos=True)) is None
    got, ended = {0: [], 1: []}, {}
    while 0 in runner.busy or 1 in runner.busy:
        for ev in runner.step():
            got[ev.slot].append(ev.token)
            if ev.finish_reason:
                ended[ev.slot] = ev.finish_reason
        if len(got[0]) == 2 and 0 in runner.busy:
            runner.leave(0)  # cancelled
            ended[0] = "cancelled"
    assert got[0] == want_a[:2] and ended[0] == "cancelled"
    assert got[1] == want_b[:want_b.index(stop) + 1] and ended[1] == "stop"
