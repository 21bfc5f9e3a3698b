"""The fused decode step (gpu/decoder.py FusedDecoder, all Triton kernels) against the eager model, end to end.

Runs on CPU through the Triton interpreter on the tiny checkpoints of all three families: the
same kernel launches the CUDA graph captures, fed the eager path's own tokens (teacher forcing),
must give the eager logits, the same greedy token and leave the same state. The kernels round to bf16
wherever the eager path materialises a bf16 tensor (the attention probabilities included), so from the
same state the step differs only by fp32 accumulation order (step 0: < 1e-3; bit-equal here today);
later steps allow for one bf16 rounding flip carried in the state and amplified by the layers.
The graph capture, pinned control ring and timing are GPU-only (benchmarks/checks/gpu_check.py).
"""
import dataclasses

import pytest
import torch

from nexrt_vllm.engine import Engine, kernels
from nexrt_vllm.engine.errors import EngineError
from nexrt_vllm.engine.gpu.decoder import FusedDecoder
from nexrt_vllm.engine.gpu.tuning import Tuning

kernels.load(interpret=True)  # the decoder's lazy kernel imports then get the interpreted versions

torch.set_num_threads(1)
STEPS = 4
# Few, large programs: the interpreter's cost is per program, not per element.
CPU_TUNING = Tuning(gemv=((1 << 62, 64, 128, 4),), lm=(128, 256, 4), attn_splits=4, attn_block=32, gdn_block_v=64,
                    moe=(64, 128, 1), moe_down=(64, 64, 1))


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_fused_step_matches_eager(ckpt_factory, arch):
    eng = Engine.from_pretrained(ckpt_factory(arch, "bfloat16"), device="cpu", dtype="bfloat16", max_seq_len=64,
                                 progress=False)
    prompt = [5, 17, 3, 99, 42, 7, 11]
    first = int(torch.argmax(eng.prefill(prompt)))
    n0, snap = eng.export_state()
    eager_logits, inputs, tok = [], [], first
    for _ in range(STEPS):
        inputs.append(tok)
        lg = eng.decode_step(tok)
        eager_logits.append(lg)
        tok = int(torch.argmax(lg))
    _, eager_state = eng.export_state()
    eng.import_state(n0, snap)
    dec = FusedDecoder(eng.model, eng.state, mode="fused", tuning=CPU_TUNING)
    for k, t in enumerate(inputs):
        dec.tok.fill_(t)
        dec.launch()
        assert rel(dec.logits, eager_logits[k]) < (1e-3 if k == 0 else 2e-2), f"step {k}"
        top2 = torch.topk(eager_logits[k], 2).values
        if top2[0] - top2[1] > 0.05:  # not a near tie: the greedy token must agree
            assert int(dec.tok) == int(torch.argmax(eager_logits[k])), f"step {k}"
    assert int(eng.state.position) == n0 + STEPS and int(dec.step) == STEPS
    eng.state.set_seq_len(n0 + STEPS)  # the fused steps advanced only the device position
    _, fused_state = eng.export_state()
    assert set(fused_state) == set(eager_state)
    for name, ref in eager_state.items():
        assert rel(fused_state[name], ref) < 2e-2, name


def test_fused_decoder_refuses_non_bf16(ckpt_factory):
    eng = Engine.from_pretrained(ckpt_factory("qwen3_5", "bfloat16"), device="cpu", dtype="float32",
                                 max_seq_len=16, progress=False)
    with pytest.raises(EngineError, match="bfloat16"):
        FusedDecoder(eng.model, eng.state)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_plan_launches_per_layer(ckpt_factory, arch):
    """The step's launch list (what the step runs and the benchmark times and counts per group):
    embedding, then per layer its mixer's then its FFN's launches tagged with the layer, then lm_head;
    each layer's record points at that layer's own state."""
    eng = Engine.from_pretrained(ckpt_factory(arch, "bfloat16"), device="cpu", dtype="bfloat16", max_seq_len=16,
                                 progress=False)
    dec = FusedDecoder(eng.model, eng.state, mode="fused", tuning=CPU_TUNING)
    mixer = {"linear_attention": ["gdn_in_proj+conv", "gdn_step", "gdn_out_proj"],
             "full_attention": ["attn_qkv_proj", "attn_qknorm_rope_kvwrite", "attn_splitk+combine", "attn_o_proj"]}
    ffn = ["moe_router", "moe_experts"] if arch == "qwen3_5_moe" else ["mlp_gate_up+swiglu", "mlp_down"]
    want = [("embed", None)]
    for i, kind in enumerate(eng.config.layer_types):
        want += [(g, i) for g in mixer[kind] + ffn]
    want.append(("lm_head+argmax", None))
    assert [(s.group, s.layer) for s in dec.plan()] == want
    for i, layer in enumerate(dec.layers):
        assert layer.mixer.state is eng.state.layers[i]


def test_l2_prefetch_asks_for_the_next_gemv_weight(ckpt_factory):
    """Tuning.l2_prefetch: every GEMV launch asks L2 for the first bytes of the next GEMV's weight (both
    halves of a SwiGLU weight; the last layer's, of the lm_head), none from the lm_head or the other
    kernels; the step's outputs are the same bytes as without it."""
    eng = Engine.from_pretrained(ckpt_factory("qwen3_5", "bfloat16"), device="cpu", dtype="bfloat16",
                                 max_seq_len=16, progress=False)
    eng.prefill([5, 17, 3])
    n0, snap = eng.export_state()
    nbytes = 4096
    dec = FusedDecoder(eng.model, eng.state, mode="fused", tuning=dataclasses.replace(CPU_TUNING, l2_prefetch=nbytes))
    plan = dec.plan()
    off = dataclasses.replace(CPU_TUNING, l2_prefetch=0)
    assert not any(hasattr(s.run, "keywords") for s in FusedDecoder(eng.model, eng.state, mode="fused",
                                                                    tuning=off).plan())
    assert any(hasattr(s.run, "keywords") for s in FusedDecoder(eng.model, eng.state, mode="fused").plan())
    gemvs = {"gdn_in_proj+conv": lambda L: L.mixer.w_in, "gdn_out_proj": lambda L: L.mixer.w_out,
             "attn_qkv_proj": lambda L: L.mixer.w_qkv, "attn_o_proj": lambda L: L.mixer.w_o,
             "mlp_gate_up+swiglu": lambda L: L.ffn.w_gate_up, "mlp_down": lambda L: L.ffn.w_down,
             "lm_head+argmax": lambda L: dec.lm_head}
    asked = 0
    for j, s in enumerate(plan):
        want, halves = None, False
        if s.group in gemvs:
            for nxt in plan[j + 1:]:
                if nxt.group in gemvs:
                    want = gemvs[nxt.group](nxt.layer is not None and dec.layers[nxt.layer])
                    halves = nxt.group == "mlp_gate_up+swiglu"
                    break
        got = getattr(s.run, "keywords", {}).get("l2")
        if want is None:
            assert got is None, (j, s.group)
            continue
        flat, off1, each, segs = got
        assert flat.data_ptr() == want.data_ptr() and flat.numel() == want.numel() * want.element_size()
        segs_want = 2 if halves else 1
        assert (segs, off1, each) == (segs_want, flat.numel() // 2 if halves else 0,
                                      min(nbytes, flat.numel()) // segs_want // 16 * 16), s.group
        asked += 1
    assert asked >= len(dec.layers)
    tok = 7
    dec.tok.fill_(tok)
    dec.launch()
    with_l2 = (dec.logits.clone(), int(dec.tok), eng.export_state()[1])
    eng.import_state(n0, snap)
    plain = FusedDecoder(eng.model, eng.state, mode="fused", tuning=off)
    plain.tok.fill_(tok)
    plain.launch()
    assert torch.equal(plain.logits, with_l2[0]) and int(plain.tok) == with_l2[1]
    for name, t in eng.export_state()[1].items():
        assert torch.equal(t, with_l2[2][name]), name


def test_moe_models_ask_l2_for_nothing(ckpt_factory):
    """Tuning.l2_prefetch is for dense models: no launch of an MoE model's step asks L2 for anything."""
    eng = Engine.from_pretrained(ckpt_factory("qwen3_5_moe", "bfloat16"), device="cpu", dtype="bfloat16",
                                 max_seq_len=16, progress=False)
    dec = FusedDecoder(eng.model, eng.state, mode="fused", tuning=dataclasses.replace(CPU_TUNING, l2_prefetch=4096))
    assert not any(hasattr(s.run, "keywords") for s in dec.plan())
