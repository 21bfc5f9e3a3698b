"""The FP8 decode kernels (e4m3 weights + fp32 block scales, read natively) against torch on the
dequantized weights: every prologue / epilogue the FP8 path uses, the MoE experts in each fp8 / bf16
mix, fused projections that keep every source's scale grid, N and K not multiples of the block.

On CPU (CI) through the Triton interpreter (it loads float8_e4m3fn and converts it exactly); with
NEXRT_KERNEL_DEVICE=cuda (benchmarks/checks/gpu_check.py) the compiled kernels. Block scales span 2^-6..2^3
from block to block, so reading a wrong scale row or column is an error of order one, far outside the
bounds below; outputs are poisoned (NaN) before each launch.
"""
import pytest
import torch
import torch.nn.functional as F

from nexrt_vllm.engine import kernels
from nexrt_vllm.engine.fp8 import FP8Weight, cat_rows, quantize_weight
from nexrt_vllm.testing.kernel_calls import DEV, call, rel, rms1p

attention, gdn, gemv, moe, sampling, *_ = kernels.load(interpret=DEV == "cpu")

torch.set_num_threads(1)
BF = torch.bfloat16
B128 = (128, 128)


def lin(x, w):  # the eager engine on the dequantized weights: bf16 weight, fp32 accumulation
    return (w.to(BF).float() @ x.float()).to(BF)


def lin_exact(x, w8):  # e4m3 * scale exactly (fp64), bf16 input: what the kernel computes before rounding
    return (w8.q.double() * w8.full_scale().double()) @ x.double()


def nan_like(t):
    return torch.full_like(t, float("nan"))


def wide(g, *shape, block=B128):
    """A weight whose block magnitudes span 2^-6..2^3, so every block has its own scale."""
    w = torch.randn(*shape, generator=g)
    n, k = shape[-2:]
    bn, bk = block
    mag = 2.0 ** torch.randint(-6, 4, (*shape[:-2], -(-n // bn), -(-k // bk)), generator=g).float()
    return w * mag.repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :n, :k] * 0.05


def q8(g, n, k, block=B128, parts=None):
    return quantize_weight(wide(g, n, k, block=block), block, parts)


@pytest.mark.parametrize("n,k,block,bn,bk", [
    (300, 200, B128, 16, 128),   # N, K not multiples of 128; one scale column per K block
    (300, 200, B128, 2, 256),    # two scale columns per K block (x scaled per sub-block)
    (300, 200, B128, 16, 64),    # half a scale column per K block
    (150, 130, (48, 40), 32, 64),  # scale blocks 48 x 40: rows of a program straddle scale rows
    (70, 8200, B128, 16, 1024),  # K > 8192: the RMSNorm sum in a loop
])
@pytest.mark.parametrize("round_w", [False, True])
def test_fp8_gemv_rmsnorm_store(n, k, block, bn, bk, round_w):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(k, generator=g).to(BF)
    w = q8(g, n, k, block)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    y = nan_like(torch.empty(n, dtype=BF))
    call(gemv.gemv, x, w, y, pro=gemv.PRO_RMSNORM, norm_w=nw, block_n=bn, block_k=bk, round_w=round_w)
    xn = rms1p(x, nw)
    assert not y.isnan().any()
    assert rel(y, lin(xn, w.dequant(torch.float32))) < 8e-3
    if round_w:  # the oracle's bf16 weights: equal to its output up to the order of fp32 sums
        assert rel(y, lin(xn, w.dequant(BF))) < 4e-3
    else:  # the stored values exactly, then one bf16 rounding
        assert rel(y, lin_exact(xn, w)) < 4e-3


def test_fp8_gemv_fused_parts_keep_their_scale_grids():
    """q | k | v concatenated as the engine fuses them: each part's scale rows follow the previous
    part's, parts of 70 / 40 / 40 rows (a 16-row program straddles two parts' grids)."""
    g = torch.Generator().manual_seed(2)
    parts = [q8(g, 70, 160), q8(g, 40, 160), q8(g, 40, 160)]
    w = cat_rows(parts)
    assert w.scale.shape[0] == 3 and w.srow.tolist()[69:71] == [0, 1]
    x = torch.randn(160, generator=g).to(BF)
    ref = torch.cat([lin(x, p.dequant(torch.float32)) for p in parts])
    for bn in (16, 2):  # per-row scale rows / one scale row per program
        y = nan_like(torch.empty(150, dtype=BF))
        call(gemv.gemv, x, w, y, block_n=bn, block_k=128)
        assert rel(y, ref) < 8e-3, bn


@pytest.mark.parametrize("inter,layout,bn,block", [
    (200, "parts", 8, B128),        # checkpoint gate_proj / up_proj: the up scale rows start at ceil(200/128)
    (200, "parts", 32, (48, 40)),   # 32-row programs straddle 48-row scale blocks
    (200, "stacked", 16, B128),     # one [2I, K] checkpoint tensor: up row r in scale row (200 + r) // 128
])
@pytest.mark.parametrize("round_w", [False, True])
def test_fp8_gemv_swiglu(inter, layout, bn, block, round_w):
    g = torch.Generator().manual_seed(3)
    k = 192
    w = q8(g, 2 * inter, k, block, parts=(inter, inter) if layout == "parts" else None)
    x = torch.randn(k, generator=g).to(BF)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    act = nan_like(torch.empty(inter, dtype=BF))
    call(gemv.gemv, x, w, act, pro=gemv.PRO_RMSNORM, epi=gemv.EPI_SWIGLU, norm_w=nw, block_n=bn, block_k=128,
         round_w=round_w)
    xn, wd = rms1p(x, nw), w.dequant(torch.float32)
    ref = (F.silu(lin(xn, wd[:inter])) * lin(xn, wd[inter:])).to(BF)
    assert rel(act, ref) < 8e-3 and not act.isnan().any()


def test_fp8_gemv_residual():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(333, generator=g).to(BF)
    w = q8(g, 150, 333)
    res = torch.randn(150, generator=g).to(BF)
    ref = res + lin(x, w.dequant(torch.float32))
    call(gemv.gemv, x, w, res, epi=gemv.EPI_RESIDUAL, block_n=8, block_k=256)
    assert rel(res, ref) < 8e-3


@pytest.mark.parametrize("bn", [8, 2])
def test_fp8_gemv_conv_epilogue_with_bf16_tail(bn):
    """GDN in_proj: [qkv | z] in fp8 and [b | a] kept bf16 (the published checkpoints' choice) in
    one launch; the conv on the first CONV_N rows updates its state in place."""
    g = torch.Generator().manual_seed(5)
    conv_n, zn, nv, kc, k = 96, 64, 8, 4, 160
    qkv, z = q8(g, conv_n, k), q8(g, zn, k)
    b, a = (torch.randn(nv, k, generator=g) * 0.2).to(BF), (torch.randn(nv, k, generator=g) * 0.2).to(BF)
    w = cat_rows([qkv, z, b, a])
    assert w.n8 == conv_n + zn and w.tail.shape == (2 * nv, k) and w.shape == (conv_n + zn + 2 * nv, k)
    x = torch.randn(k, generator=g).to(BF)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    cw = (torch.randn(conv_n, kc, generator=g) * 0.5).to(BF)
    st = torch.randn(conv_n, kc - 1, generator=g).to(BF)
    st_ref = st.clone()
    y = nan_like(torch.empty(w.shape[0], dtype=BF))
    call(gemv.gemv, x, w, y, pro=gemv.PRO_RMSNORM, epi=gemv.EPI_CONV, norm_w=nw, aux0=st, aux1=cw, conv_n=conv_n,
         kc=kc, block_n=bn, block_k=64)
    xn = rms1p(x, nw)
    proj = lin(xn, w.dequant(torch.float32))
    assert torch.equal(w.dequant(BF)[conv_n + zn:], torch.cat([b, a]))
    window = torch.cat([st_ref, proj[:conv_n, None]], 1)
    conv = (window.float() * cw.float()).sum(1).to(BF)
    assert rel(y[:conv_n], F.silu(conv)) < 8e-3
    assert rel(y[conv_n:conv_n + zn], proj[conv_n:conv_n + zn]) < 8e-3
    assert torch.equal(y[conv_n + zn:], lin(xn, torch.cat([b, a]).float()))  # the bf16 rows: the bf16 loop
    assert torch.equal(st[:, :-1], st_ref[:, 1:]) and rel(st[:, -1], proj[:conv_n]) < 8e-3


def test_fp8_gemv_tail_needs_whole_programs():
    g = torch.Generator().manual_seed(6)
    w = cat_rows([q8(g, 20, 64), (torch.randn(4, 64, generator=g)).to(BF)])
    with pytest.raises(ValueError, match="20 fp8 rows before the bf16 tail are not a multiple of block_n 8"):
        gemv.gemv(torch.zeros(64, dtype=BF), w, torch.zeros(24, dtype=BF), block_n=8)


@pytest.mark.parametrize("block_k", [32, 64])
def test_fp8_gemv_gated_norm_prologue(block_k):
    g = torch.Generator().manual_seed(7)
    heads, dv, n = 4, 32, 40
    o = torch.randn(heads * dv, generator=g).to(BF)
    z = torch.randn(heads * dv, generator=g).to(BF)
    nw = (1 + 0.1 * torch.randn(dv, generator=g)).to(BF)
    w = q8(g, n, heads * dv, block=(16, 32))
    res = torch.randn(n, generator=g).to(BF)
    oh = o.view(heads, dv).float()
    normed = (oh * torch.rsqrt(oh.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF)
    gated = ((nw * normed).float() * F.silu(z.view(heads, dv).float())).to(BF).view(-1)
    ref = res + lin(gated, w.dequant(torch.float32))
    call(gemv.gemv, o, w, res, pro=gemv.PRO_GATED, epi=gemv.EPI_RESIDUAL, norm_w=nw, z=z, group=dv, block_n=8,
         block_k=block_k)
    assert rel(res, ref) < 8e-3


def test_fp8_lm_head_argmax():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(200, generator=g).to(BF)
    nw = (torch.randn(200, generator=g) * 0.1).to(BF)
    w = q8(g, 300, 200)
    logits = nan_like(torch.empty(300))
    npart = -(-300 // 32)
    pmax, pidx = torch.empty(npart), torch.empty(npart, dtype=torch.int32)
    call(gemv.gemv, x, w, logits, pro=gemv.PRO_RMSNORM, epi=gemv.EPI_ARGMAX, norm_w=nw, aux0=pmax, aux1=pidx,
         block_n=32, block_k=128)
    assert rel(logits, lin(rms1p(x, nw), w.dequant(torch.float32)).float()) < 8e-3
    tok, pos, step = torch.zeros(1, dtype=torch.int64), torch.tensor([7]), torch.tensor([41])
    call(sampling.finish, pmax, pidx, npart, tok, pos, step, torch.full((4,), -1, dtype=torch.int64), 4)
    assert int(tok) == int(torch.argmax(logits))


def _moe_ref(res, norm_w, wr, gu, sgu, dn, sdn, topk, E):
    h = rms1p(res, norm_w)
    logits = lin(h, wr)
    probs = torch.softmax(logits[:E].float(), -1)
    top_v, top_i = torch.topk(probs, topk)
    top_v = (top_v / top_v.sum()).to(BF)
    d = [lambda t: t.dequant(torch.float32) if isinstance(t, FP8Weight) else t][0]
    gud, dnd = d(gu), d(dn)
    out = torch.zeros_like(res)
    for e in sorted(top_i.tolist()):
        gg, uu = lin(h, gud[e]).chunk(2)
        out = out + lin(F.silu(gg) * uu, dnd[e]) * top_v[top_i.tolist().index(e)]
    sg, su = lin(h, d(sgu)).chunk(2)
    shared = torch.sigmoid(logits[E:]) * lin(F.silu(sg) * su, d(sdn))
    return h, res + (out + shared), sorted(top_i.tolist())


@pytest.mark.parametrize("routed,shared,block,shape,round_w", [
    ("fp8", "fp8", B128, (2, 1, 1), False),       # the GPU defaults' shape (one warp, 2 rows / 1 row)
    ("fp8", "fp8", B128, (2, 1, 1), True),
    ("fp8", "fp8", (48, 40), (16, 8, 4), False),  # scale rows straddled by a program, K sub-blocks of 8
    ("fp8", "fp8", (48, 40), (16, 8, 4), True),
    ("fp8", "bf16", B128, (8, 4, 4), False),
    ("bf16", "fp8", B128, (8, 4, 4), False),
])
def test_fp8_moe_experts(routed, shared, block, shape, round_w):
    bn, dbn, nw = shape
    g = torch.Generator().manual_seed(9)
    E, hid, inter, inter_s, topk = 16, 200, 40, 72, 3
    res = torch.randn(hid, generator=g).to(BF)
    norm_w = (0.1 * torch.randn(hid, generator=g)).to(BF)
    wr = (torch.randn(E + 1, hid, generator=g) * 0.3).to(BF)

    def make(fmt, *shape_, parts=None):
        w = wide(g, *shape_, block=block) * 4
        return quantize_weight(w, block, parts) if fmt == "fp8" else w.to(BF)

    gu = make(routed, E, 2 * inter, hid, parts=(inter, inter))
    dn = make(routed, E, hid, inter)
    sgu = make(shared, 2 * inter_s, hid, parts=(inter_s, inter_s))
    sdn = make(shared, hid, inter_s)
    h, ref, want_ids = _moe_ref(res, norm_w, wr, gu, sgu, dn, sdn, topk, E)
    res_start = res.clone()
    lg = nan_like(torch.empty(E + 1, dtype=BF))
    ids, wts = torch.full((topk,), -1, dtype=torch.int32), nan_like(torch.empty(topk))
    xn = nan_like(torch.empty(hid, dtype=BF))
    call(gemv.gemv, res, wr, lg, pro=gemv.PRO_RMSNORM, norm_w=norm_w, xn_out=xn, block_n=8, block_k=64)
    assert torch.equal(xn, h)
    act = nan_like(torch.empty((topk + 1) * inter_s, dtype=BF))
    call(moe.moe_experts, xn, res, lg, gu, sgu, dn, sdn, act, ids, wts, top_k=topk, block_n=bn, block_k=64,
         down_block_n=dbn, down_block_k=32, num_warps=nw, down_num_warps=nw, round_w=round_w)
    assert ids.tolist() == want_ids
    d = lambda x: x.float() - res_start.float()  # noqa: E731 - the MoE's contribution
    assert rel(d(res), d(ref)) < 2e-2, rel(d(res), d(ref))


def test_fp8_router_stores_normed_input():
    g = torch.Generator().manual_seed(10)
    res = torch.randn(200, generator=g).to(BF)
    nw = (0.1 * torch.randn(200, generator=g)).to(BF)
    w = q8(g, 17, 200)
    lg, xn = nan_like(torch.empty(17, dtype=BF)), nan_like(torch.empty(200, dtype=BF))
    call(gemv.gemv, res, w, lg, pro=gemv.PRO_RMSNORM, norm_w=nw, xn_out=xn, block_n=4, block_k=128)
    assert torch.equal(xn, rms1p(res, nw))
    assert rel(lg, lin(xn, w.dequant(torch.float32))) < 8e-3
