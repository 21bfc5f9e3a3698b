"""`Tuning.gdn_verify_recompute` on the GPU (marked `gpu`): the verify keeps no GDN state per position and
the commit runs the accepted positions again from the live state. Exact by construction (the commit's
programs are the verify's, over the same rows), which only compiled kernels can show:

1. the kernels at the real head shapes (2B: 16 key / 16 value heads, 35B-A3B: 16 / 32; 128 x 128), over
   launch shapes, PDL off and on: the verify's outputs and, for every accepted count, the committed
   recurrent and conv states equal the per-position path's bit for bit;
2. the captured round graph on the trained tiny MTP checkpoints (the three families), with the knob on
   against off: the same tokens and afterwards the same state bit for bit, from the full context,
   after a hand-off (placeholder drafts: nothing accepted) and under a pinned acceptance schedule
   (every accepted count).

    python -m pytest -m gpu tests/gpu/test_gdn_verify_recompute.py
"""
import pytest
import torch

from nexrt_vllm.testing.connector_harness import TRAINED_MTP

pytestmark = pytest.mark.gpu

BF = torch.bfloat16
M, KC = 4, 4


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("block_v,warps", [(16, 1), (32, 1), (16, 4), (64, 4)])  # the default first
@pytest.mark.parametrize("hk,hv", [(16, 16), (16, 32)])
def test_kernels_bit_for_bit_at_the_real_shapes(hk, hv, block_v, warps, pdl):
    from nexrt_vllm.engine.kernels import common, gdn

    dk = dv = 128
    kd, vd = hk * dk, hv * dv
    g = torch.Generator().manual_seed(hk + hv + block_v + warps)
    buf = torch.randn(M, 2 * kd + 2 * vd + 2 * hv + 8, generator=g).to(BF).cuda()  # a row stride past the row
    live = (torch.randn(hv, dk, dv, generator=g) * 0.3).cuda()
    a_log = (torch.rand(hv, generator=g) * 15 + 1).log().to(BF).cuda()
    dt_bias = (torch.randn(hv, generator=g) * 0.5).to(BF).cuda()
    window = torch.randn(2 * kd + vd, KC - 1 + M, generator=g).to(BF).cuda()
    shape = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, block_v=block_v, num_warps=warps,
                 prefetch=pdl)
    nan = float("nan")
    with common.launch_options(pdl):
        rec_after = torch.full((M, hv, dk, dv), nan, device="cuda")
        out_keep, out = (torch.full((M, vd), nan, dtype=BF, device="cuda") for _ in range(2))
        gdn.gdn_verify_step(buf, live, rec_after, out_keep, a_log, dt_bias, m=M, **shape)
        gdn.gdn_verify_step(buf, live, None, out, a_log, dt_bias, m=M, **shape)
        for a in range(M):
            acc = torch.tensor([a], device="cuda")
            conv_copy = torch.full((window.shape[0], KC - 1), nan, dtype=BF, device="cuda")
            rec_copy = torch.full_like(live, nan)
            gdn.gdn_commit(conv_copy, rec_copy, window, rec_after, acc)
            conv, rec = torch.full_like(conv_copy, nan), live.clone()
            gdn.gdn_commit_recompute(conv, rec, window, buf, acc, a_log, dt_bias, **shape)
            torch.cuda.synchronize()
            assert torch.equal(rec, rec_copy) and torch.equal(conv, conv_copy), (a, (rec - rec_copy).abs().max())
    assert torch.equal(out, out_keep) and not out.isnan().any()


def _graph_engine(path: str, recompute: bool, max_len: int, synthetic=None):
    from nexrt_vllm.engine import Engine
    from nexrt_vllm.engine.gpu.decoder import FusedDecoder
    from nexrt_vllm.engine.gpu.runner import GraphRunner
    from nexrt_vllm.engine.gpu.spec_round import SpecRunner
    from nexrt_vllm.engine.gpu.tuning import Tuning

    eng = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", max_seq_len=max_len, progress=False)
    eng.enable_speculative("mtp", M - 1, synthetic=synthetic)
    runner = GraphRunner(FusedDecoder(eng.model, eng.state, mode="fused",
                                      tuning=Tuning(gdn_verify_recompute=recompute)))
    runner.capture()
    eng.graph = runner
    eng.spec_graph = SpecRunner(runner, eng.speculative)
    eng.spec_graph.capture()
    assert eng.spec_graph.graph is not None and eng.spec_graph.d.recompute == recompute
    return eng


@pytest.mark.parametrize("case", ["full_context", "handed_off", "pinned"])
@pytest.mark.parametrize("arch", sorted(TRAINED_MTP))
def test_round_graph_recomputing_equals_the_copy(ckpt_factory, arch, case):
    from nexrt_vllm.bench.step import periodic_prompt
    from nexrt_vllm.engine import SamplingParams
    from nexrt_vllm.engine.spec.synthetic import SyntheticAcceptance

    path = ckpt_factory(arch, "bfloat16", **TRAINED_MTP[arch])
    prompt, steps = periodic_prompt(380, period=11)[0], 128
    sp = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    runs = []
    for recompute in (False, True):
        synthetic = SyntheticAcceptance((0.8, 0.5, 0.3), seed=4) if case == "pinned" else None
        eng = _graph_engine(path, recompute, len(prompt) + steps + 4 * M, synthetic)
        first = int(eng.prefill(prompt).argmax())
        if case == "handed_off":
            eng.import_state(*eng.export_state())
        eng.speculative.rounds = [0] * (M + 1)
        tokens = [first] + list(eng.stream(first, sp))
        n, state = eng.export_state()
        runs.append((tokens, list(eng.speculative.rounds), n, state))
        del eng
        torch.cuda.empty_cache()
    (t0, r0, n0, s0), (t1, r1, n1, s1) = runs
    assert t1 == t0 and r1 == r0 and n1 == n0, (t0, t1, r0, r1)
    assert sum(r0) > 0 and (case != "pinned" or sum(c > 0 for c in r0[1:]) >= 3), r0  # the counts it ran
    differ = [name for name in s0 if not torch.equal(s0[name], s1[name])]
    assert not differ, differ
