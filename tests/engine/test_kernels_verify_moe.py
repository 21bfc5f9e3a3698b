"""The MoE experts over M = 2..4 positions in one launch pair (`moe.moe_experts(..., m=M)`, the MTP
verify pass) against the eager engine (`model.moe_decode` on each row, as `Model._step_layers` runs a
verify) and against M separate m = 1 launches, which the M-row kernels must equal bit for bit in the
interpreter (the same products, fp32 sums and bf16 rounding per row; on the GPU the per-row
reductions run on a 3-D layout, so there they are held to a tight relative bound instead).

Rows are made to share experts (a repeated row; 8 experts top-4: three rows cannot be disjoint), so
the union programs' per-row slots and the publishing of ids / wts are exercised. Outputs are
poisoned (NaN) before each launch; on CPU through the Triton interpreter like the other kernel tests.
"""
import types

import pytest
import torch

from nexrt_vllm.engine import kernels
from nexrt_vllm.engine.fp8 import quantize_weight
from nexrt_vllm.engine.model import MLPWeights, MoEWeights, moe_decode
from nexrt_vllm.testing.kernel_calls import DEV, call, rel, rms1p

moe = kernels.load(interpret=DEV == "cpu")[kernels.MODULES.index("moe")]

torch.set_num_threads(1)
BF = torch.bfloat16
HID, INTER, INTER_S = 64, 32, 32
LAUNCH = dict(block_n=16, block_k=32, down_block_n=16, down_block_k=16, num_warps=4, down_num_warps=4)


def lin(x, w):  # bf16 linear with fp32 accumulation, as a GPU GEMM
    return (w.float() @ x.float()).to(x.dtype)


def nan_like(t):
    return torch.full_like(t, float("nan"))


def _same(a, b):
    return torch.equal(a, b) if DEV == "cpu" else rel(a, b) < 1e-2


def _weights(g, E, fp8=False):
    wr = (torch.randn(E + 1, HID, generator=g) * 0.3).to(BF)
    gu = (torch.randn(E, 2 * INTER, HID, generator=g) * 0.2).to(BF)
    dn = (torch.randn(E, HID, INTER, generator=g) * 0.2).to(BF)
    sgu = (torch.randn(2 * INTER_S, HID, generator=g) * 0.2).to(BF)
    sdn = (torch.randn(HID, INTER_S, generator=g) * 0.2).to(BF)
    if fp8:  # 32 x 32 scale blocks: several per weight
        b = (32, 32)
        gu, dn = quantize_weight(gu.float(), b, (INTER, INTER)), quantize_weight(dn.float(), b)
        sgu, sdn = quantize_weight(sgu.float(), b, (INTER_S, INTER_S)), quantize_weight(sdn.float(), b)
    return wr, gu, dn, sgu, sdn


def _rows(g, m, share):
    """m residual rows, with `share` the last a copy of the first (the same experts), and their normed
    inputs (what the router launch leaves)."""
    res = torch.randn(m, HID, generator=g).to(BF)
    if share:
        res[m - 1] = res[0]
    norm_w = (0.1 * torch.randn(HID, generator=g)).to(BF)
    return res, torch.stack([rms1p(r, norm_w) for r in res])


def _scratch(m, topk):
    act = nan_like(torch.empty(m, topk + 1, max(INTER, INTER_S), dtype=BF))
    return act, torch.full((m, topk), -1, dtype=torch.int32), nan_like(torch.empty(m, topk))


def _deq(w):
    return w.dequant(torch.float32).to(BF) if hasattr(w, "dequant") else w


def _eager(res, xn, wr, gu, dn, sgu, sdn, E, topk, norm):
    """res + moe_decode(row) for each row: the eager verify pass's MoE (Model._step_layers)."""
    sg, su = _deq(sgu).chunk(2)
    w = MoEWeights(router=wr[:E], gate_up_proj=_deq(gu), down_proj=_deq(dn),
                   shared=MLPWeights(sg, su, _deq(sdn)), shared_gate=wr[E:])
    cfg = types.SimpleNamespace(num_experts_per_tok=topk, norm_topk_prob=norm)
    return res + torch.cat([moe_decode(w, cfg, xn[j:j + 1]) for j in range(xn.shape[0])])


def _run(m, E, topk, norm, fp8, share, seed):
    g = torch.Generator().manual_seed(seed)
    wr, gu, dn, sgu, sdn = _weights(g, E, fp8)
    res0, xn = _rows(g, m, share)
    logits = torch.stack([lin(x, wr) for x in xn])  # the router launch's [m, E+1]
    # M rows in one launch pair
    res = res0.clone()
    act, ids, wts = _scratch(m, topk)
    call(moe.moe_experts, xn, res, logits, gu, sgu, dn, sdn, act, ids, wts, top_k=topk, norm_topk=norm, m=m,
         **LAUNCH)
    # m separate m = 1 launches
    ones = []
    for j in range(m):
        r1 = res0[j].clone()
        a1, i1, w1 = _scratch(1, topk)
        call(moe.moe_experts, xn[j].clone(), r1, logits[j].clone(), gu, sgu, dn, sdn, a1.view(-1), i1.view(-1),
             w1.view(-1), top_k=topk, norm_topk=norm, **LAUNCH)
        ones.append((r1, a1[0], i1[0], w1[0]))
    if share or m * topk > E:  # the union really shares experts between rows
        assert len(set(ids.flatten().tolist())) < m * topk
    for j, (r1, a1, i1, w1) in enumerate(ones):
        want = torch.topk(torch.softmax(logits[j, :E].float(), -1), topk).indices
        assert ids[j].tolist() == sorted(want.tolist()) == i1.tolist(), j
        assert _same(wts[j], w1), j
        assert _same(act[j, :topk, :INTER], a1[:topk, :INTER]) and _same(act[j, topk, :INTER_S], a1[topk, :INTER_S])
        assert _same(res[j], r1), (j, rel(res[j], r1))
    ref = _eager(res0, xn, wr, gu, dn, sgu, sdn, E, topk, norm)
    d = lambda x: x.float() - res0.float()  # noqa: E731 - the MoE's contribution, not the residual
    for j in range(m):
        assert rel(d(res)[j], d(ref)[j]) < 2e-2, (j, rel(d(res)[j], d(ref)[j]))
    assert not res.isnan().any()


@pytest.mark.parametrize("m,E,topk,norm,share", [
    (2, 8, 2, True, False),   # (this seed: disjoint rows)
    (2, 16, 4, False, True),  # two rows, the same experts
    (3, 8, 2, True, True),
    (3, 8, 4, False, True),   # 12 picks of 8 experts: partial overlaps besides the repeated row
    (4, 16, 4, True, True),
    (4, 8, 4, False, False),
])
def test_verify_moe_bf16(m, E, topk, norm, share):
    _run(m, E, topk, norm, False, share, seed=10 * m + E + topk)


@pytest.mark.parametrize("m,norm,share", [(2, False, True), (4, True, False)])
def test_verify_moe_fp8(m, norm, share):
    """fp8 routed and shared experts (the shared bodies read e4m3 + block scales for the M rows too)."""
    _run(m, 8, 4, norm, True, share, seed=40 + m)


def test_verify_moe_rejects_bad_shapes():
    g = torch.Generator().manual_seed(3)
    wr, gu, dn, sgu, sdn = _weights(g, 8)
    act, ids, wts = _scratch(2, 2)
    x = torch.zeros(2, HID, dtype=BF)
    with pytest.raises(ValueError, match="m = 5"):
        moe.moe_experts(x, x, torch.zeros(2, 9, dtype=BF), gu, sgu, dn, sdn, act, ids, wts, top_k=2, m=5)
    with pytest.raises(ValueError, match="act"):
        moe.moe_experts(x, x.clone(), torch.zeros(2, 9, dtype=BF), gu, sgu, dn, sdn, act.view(2, -1), ids, wts,
                        top_k=2, m=2)
