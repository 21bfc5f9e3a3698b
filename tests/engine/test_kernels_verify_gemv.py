"""The M-row GEMV of the verify pass and the batch step (`gemv(..., m=M)`, kernels/gemv_verify.py
`gemv_rows_kernel` and the tensor-core `gemv_rows_dot_kernel`): every row against the M = 1 kernel on that row
alone and against torch.

Each prologue x epilogue the decode step launches, for M = 2, 4 and 8 (3 once: padded to 4 rows), with
and without the prefetched head; x / y / z / the conv window are strided views as the verify's
buffers are. Outputs are poisoned (NaN) before each launch. The M rows differ from M separate launches
only in the order of the fp32 sums (one FMA chain per 16-byte run instead of a tree, or the tensor cores'
order), so the bf16 outputs agree to a last-place flip: `SAME`.

FP8 weights (fp8.FP8Weight): scale blocks that programs share or straddle, SwiGLU halves with grids of their
own, a bf16 tail; each row against the one-row fp8 kernel with the same products and against torch on the
dequantized weight. The tensor-core kernel scales a K block's sums when the block lies inside one scale block
(the one-row kernel's products, up to fp32 rounding), else multiplies bf16(e4m3 * scale) (its `round_w`).
"""
import pytest
import torch
import torch.nn.functional as F

from nexrt_vllm.engine import kernels
from nexrt_vllm.engine.fp8 import cat_rows, quantize_weight
from nexrt_vllm.testing.kernel_calls import DEV, call, rel, rms1p

kernels.load(interpret=DEV == "cpu")
from nexrt_vllm.engine.kernels import gemv, sampling  # noqa: E402 - after load() picked the mode

torch.set_num_threads(1)
BF = torch.bfloat16
SAME = 2e-3  # M rows vs M launches of one row: fp32 summation order only
REF = 8e-3  # vs torch (a GPU GEMM's bf16 result), as tests/engine/test_kernels_decode_ops.py


def lin(x, w):  # bf16 linear with fp32 accumulation, rows of x
    return (x.float() @ w.float().t()).to(x.dtype)


def nan_like(t):
    return torch.full_like(t, float("nan"))


def rows(t, m, extra=8):
    """t [m, c] as a strided view of a wider buffer (row stride c + extra), as the verify's buffers are."""
    buf = torch.full((m, t.shape[1] + extra), float("nan"), dtype=t.dtype)
    buf[:, :t.shape[1]] = t
    return buf[:, :t.shape[1]]


def nan_rows(m, c, dtype=BF):
    return rows(torch.full((m, c), float("nan"), dtype=dtype), m)


@pytest.fixture(autouse=True, params=[0, 3], ids=["fold", "dot"])
def kernel(request, monkeypatch):
    """Every M-row call of a test on both kernels: the fold kernel (`dot` 0) and the tensor-core one with 3
    pipeline stages (16 weight rows per program at least)."""
    orig = gemv.gemv

    def call_m(*a, **kw):
        if kw.get("m", 1) > 1 and request.param and "dot" not in kw:
            kw = dict(kw, dot=request.param, block_n=max(kw.get("block_n") or 16, 16))
        return orig(*a, **kw)

    monkeypatch.setattr(gemv, "gemv", call_m)
    return request.param


MS = pytest.mark.parametrize("m", [2, 4, 8])  # 8: the batch step's most slots
PREFETCH = pytest.mark.parametrize("prefetch", [0, 2])


@MS
@PREFETCH
def test_rmsnorm_store(m, prefetch):
    g = torch.Generator().manual_seed(11)
    k, n = 96, 70
    x = rows(torch.randn(m, k, generator=g).to(BF), m)
    w = (torch.randn(n, k, generator=g) * 0.1).to(BF)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    y = nan_rows(m, n)
    call(gemv.gemv, x, w, y, pro=gemv.PRO_RMSNORM, norm_w=nw, block_n=16, block_k=32, prefetch=prefetch, m=m)
    assert not y.isnan().any()
    for j in range(m):
        y1 = nan_like(torch.empty(n, dtype=BF))
        call(gemv.gemv, x[j], w, y1, pro=gemv.PRO_RMSNORM, norm_w=nw, block_n=16, block_k=32, prefetch=prefetch)
        assert rel(y[j], y1) < SAME, j
        assert rel(y[j], lin(rms1p(x[j], nw)[None], w)[0]) < REF, j


@pytest.mark.parametrize("m,k,block_k,prefetch", [(3, 100, 32, 2), (3, 8200, 1024, 0)])
def test_rmsnorm_store_three_rows_ragged_k(m, k, block_k, prefetch):
    """M = 3 (padded to 4, the 4th row masked) with K not a multiple of BLOCK_K (the last block's
    columns masked); K > 8192 / 4: the rows' RMS is a loop over K blocks."""
    g = torch.Generator().manual_seed(12)
    n = 40
    x = rows(torch.randn(m, k, generator=g).to(BF), m)
    w = (torch.randn(n, k, generator=g) * 0.1).to(BF)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    y = torch.full((4, n), float("nan"), dtype=BF)  # the padded row must stay untouched
    call(gemv.gemv, x, w, y, pro=gemv.PRO_RMSNORM, norm_w=nw, block_n=16, block_k=block_k, prefetch=prefetch, m=m)
    assert not y[:m].isnan().any() and y[m:].isnan().all()
    for j in range(m):
        y1 = nan_like(torch.empty(n, dtype=BF))
        call(gemv.gemv, x[j], w, y1, pro=gemv.PRO_RMSNORM, norm_w=nw, block_n=16, block_k=block_k, prefetch=prefetch)
        assert rel(y[j], y1) < SAME, j
        assert rel(y[j], lin(rms1p(x[j], nw)[None], w)[0]) < REF, j


@MS
@PREFETCH
def test_rmsnorm_swiglu(m, prefetch):
    g = torch.Generator().manual_seed(13)
    k, n = 64, 40
    x = rows(torch.randn(m, k, generator=g).to(BF), m)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    wgu = (torch.randn(2 * n, k, generator=g) * 0.2).to(BF)
    act = nan_rows(m, n)
    call(gemv.gemv, x, wgu, act, pro=gemv.PRO_RMSNORM, epi=gemv.EPI_SWIGLU, norm_w=nw, block_n=16, block_k=32,
         prefetch=prefetch, m=m)
    assert not act.isnan().any()
    h = rms1p(x, nw)
    ref = F.silu(lin(h, wgu[:n])) * lin(h, wgu[n:])
    for j in range(m):
        a1 = nan_like(torch.empty(n, dtype=BF))
        call(gemv.gemv, x[j], wgu, a1, pro=gemv.PRO_RMSNORM, epi=gemv.EPI_SWIGLU, norm_w=nw, block_n=16, block_k=32,
             prefetch=prefetch)
        assert rel(act[j], a1) < SAME, j
        assert rel(act[j], ref[j]) < REF, j


@MS
@pytest.mark.parametrize("prefetch", [0, 2, 4])  # 4: four head blocks, then the loop
def test_plain_residual(m, prefetch):
    g = torch.Generator().manual_seed(14)
    k, n = 160, 50
    x = rows(torch.randn(m, k, generator=g).to(BF), m)
    wd = (torch.randn(n, k, generator=g) * 0.2).to(BF)
    res = rows(torch.randn(m, n, generator=g).to(BF), m)
    res0 = res.clone()
    call(gemv.gemv, x, wd, res, epi=gemv.EPI_RESIDUAL, block_n=16, block_k=32, prefetch=prefetch, m=m)
    ref = res0 + lin(x, wd)
    for j in range(m):
        r1 = res0[j].clone()
        call(gemv.gemv, x[j], wd, r1, epi=gemv.EPI_RESIDUAL, block_n=16, block_k=32, prefetch=prefetch)
        assert rel(res[j], r1) < SAME, j
        assert rel(res[j], ref[j]) < REF, j


def gated_case(m: int, heads: int, dv: int, n: int, seed: int):
    """A GDN out_proj's inputs over m rows: (o, z — the gate rows, a strided view of the in_proj output —, the
    norm weight, W [n, heads*dv], the residual rows) and torch's gated RMSNorm of o."""
    g = torch.Generator().manual_seed(seed)
    vd = heads * dv
    o = rows(torch.randn(m, vd, generator=g).to(BF), m)
    buf = torch.randn(m, 3 * vd, generator=g).to(BF)
    z = buf[:, vd:2 * vd]
    nw = (1 + 0.1 * torch.randn(dv, generator=g)).to(BF)
    w = (torch.randn(n, vd, generator=g) * 0.2).to(BF)
    res0 = rows(torch.randn(m, n, generator=g).to(BF), m)
    oh = o.reshape(m, heads, dv).float()
    normed = (oh * torch.rsqrt(oh.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF)
    gated = ((nw * normed).float() * F.silu(z.reshape(m, heads, dv).float())).to(BF).reshape(m, vd)
    return o, z, nw, w, res0, gated


@MS
@PREFETCH
@pytest.mark.parametrize("block_k", [32, 64])  # one head, two heads per K block
def test_gated_residual(m, prefetch, block_k):
    """The GDN out_proj: gated RMSNorm per head with z the gate rows of the in_proj output (a strided
    view of the [m, width] buffer)."""
    dv = 32
    o, z, nw, w, res0, gated = gated_case(m, 4, dv, 24, seed=15)
    res = res0.clone()
    call(gemv.gemv, o, w, res, pro=gemv.PRO_GATED, epi=gemv.EPI_RESIDUAL, norm_w=nw, z=z, group=dv, block_n=8,
         block_k=block_k, prefetch=prefetch, m=m)
    ref = res0 + lin(gated, w)
    for j in range(m):
        r1 = res0[j].clone()
        call(gemv.gemv, o[j], w, r1, pro=gemv.PRO_GATED, epi=gemv.EPI_RESIDUAL, norm_w=nw, z=z[j], group=dv,
             block_n=8, block_k=block_k, prefetch=prefetch)
        assert rel(res[j], r1) < SAME, j
        assert rel(res[j], ref[j]) < REF, j


@pytest.mark.parametrize("m", [2, 8, 12, 32])  # 12, 32: the batched round's rows (tensor-core kernel only)
def test_gated_norm_rows_then_plain_gemv_equals_the_gated_prologue(m):
    """Many rows: the GDN output norm in a launch of its own (kernels/gdn.py `gated_norm_rows`, in place
    over the GDN output) and then a plain residual GEMV give the PRO_GATED launch's outputs; the normed rows
    are torch's gated RMSNorm."""
    from nexrt_vllm.engine.kernels import gdn

    dv = 32
    o, z, nw, w, res0, gated = gated_case(m, 8, dv, 40, seed=17)
    dot = {} if m <= 8 else {"dot": 2}
    fused = res0.clone()
    call(gemv.gemv, o, w, fused, pro=gemv.PRO_GATED, epi=gemv.EPI_RESIDUAL, norm_w=nw, z=z, group=dv, block_n=16,
         block_k=64, m=m, **dot)
    x = nan_rows(m, o.shape[1])
    call(gdn.gated_norm_rows, o, z, nw, x, m=m, group=dv, eps=1e-6, block=64)  # two heads a program
    assert rel(x, gated) < REF
    if DEV == "cpu":  # in place over the GDN output, as the batch decoders launch it (`call` moves no aliases)
        x2 = o.clone()
        gdn.gated_norm_rows(x2, z, nw, x2, m=m, group=dv, eps=1e-6, block=64)
        assert torch.equal(x2, x)
    split = res0.clone()
    call(gemv.gemv, x, w, split, epi=gemv.EPI_RESIDUAL, block_n=16, block_k=64, m=m, **dot)
    assert rel(split, fused) < SAME
    with pytest.raises(ValueError, match="whole heads"):
        gdn.gated_norm_rows(x, z, nw, x, m=m, group=24, eps=1e-6)


@pytest.mark.parametrize("m", [2, 12, 32])  # 12, 32: the batched round's rows (Tuning.norm_rows)
def test_rmsnorm_rows_then_plain_gemv_equals_the_prologue(m):
    """Many rows: the RMSNorm in a launch of its own (gemv.py `rmsnorm_rows`) gives each row exactly what
    the one-row GEMV's prologue stores for it (xn_out), and the plain M-row GEMV over those rows the PRO_RMSNORM
    launch's outputs (SwiGLU, as the dense gate/up)."""
    g = torch.Generator().manual_seed(19)
    k, n = 2100, 24  # K past one 1024-column block, ragged
    x = rows(torch.randn(m, k, generator=g).to(BF), m)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    w = (torch.randn(2 * n, k, generator=g) * 0.05).to(BF)
    dot = {} if m <= 8 else {"dot": 2}
    fused = nan_rows(m, n)
    call(gemv.gemv, x, w, fused, pro=gemv.PRO_RMSNORM, epi=gemv.EPI_SWIGLU, norm_w=nw, block_n=16, block_k=256, m=m,
         **dot)
    xn = nan_rows(m, k)
    call(gemv.rmsnorm_rows, x, nw, xn, m=m, eps=1e-6)
    for j in (0, m - 1):
        one, xn1 = nan_like(torch.empty(n, dtype=BF)), nan_like(torch.empty(k, dtype=BF))
        call(gemv.gemv, x[j], w[:n], one, pro=gemv.PRO_RMSNORM, norm_w=nw, xn_out=xn1, block_n=8, block_k=256)
        assert torch.equal(xn[j], xn1), j  # the one-row prologue's ops, byte for byte
    split = nan_rows(m, n)
    call(gemv.gemv, xn, w, split, epi=gemv.EPI_SWIGLU, block_n=16, block_k=256, m=m, **dot)
    assert not split.isnan().any() and rel(split, fused) < SAME
    with pytest.raises(ValueError, match="must not be x"):
        gemv.rmsnorm_rows(xn, nw, xn, m=m, eps=1e-6)


@pytest.mark.parametrize("m", [2, 3, 4])
@PREFETCH
def test_rmsnorm_conv_window(m, prefetch):
    """GDN in_proj + causal conv over m consecutive tokens: the live conv state is only read, the
    window (a view of a wider scratch, as VerifyScratch.window) holds the state and the m inputs, row
    j < conv_n is the conv of token j over window[:, j:j+kc] + SiLU; the rest of the rows bf16(y_j).
    Row j equals the M = 1 kernel run token by token on a copy of the state."""
    g = torch.Generator().manual_seed(16)
    conv_n, extra, kc, k, width = 48, 20, 4, 64, 4
    x = rows(torch.randn(m, k, generator=g).to(BF), m)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    w = (torch.randn(conv_n + extra, k, generator=g) * 0.2).to(BF)
    cw = (torch.randn(conv_n, kc, generator=g) * 0.5).to(BF)
    st = torch.randn(conv_n, kc - 1, generator=g).to(BF)
    st0 = st.clone()
    scratch = torch.full((conv_n, kc - 1 + width), float("nan"), dtype=BF)
    window = scratch[:, :kc - 1 + m]
    y = nan_rows(m, conv_n + extra)
    call(gemv.gemv, x, w, y, pro=gemv.PRO_RMSNORM, epi=gemv.EPI_CONV, norm_w=nw, aux0=st, aux1=cw, conv_n=conv_n,
         kc=kc, block_n=16, block_k=32, prefetch=prefetch, m=m, window=window)
    assert torch.equal(st, st0)  # the live state: read only
    assert scratch[:, kc - 1 + m:].isnan().all()  # past the window: untouched
    proj = lin(rms1p(x, nw), w)
    assert torch.equal(window[:, :kc - 1], st0)
    assert rel(window[:, kc - 1:], proj[:, :conv_n].t()) < REF
    assert not y.isnan().any()
    st1 = st0.clone()
    for j in range(m):
        conv = (window[:, j:j + kc].float() * cw.float()).sum(1).to(BF)  # the eager conv over the window
        assert rel(y[j, :conv_n], F.silu(conv)) < REF, j
        assert rel(y[j, conv_n:], proj[j, conv_n:]) < REF, j
        y1 = nan_like(torch.empty(conv_n + extra, dtype=BF))
        call(gemv.gemv, x[j], w, y1, pro=gemv.PRO_RMSNORM, epi=gemv.EPI_CONV, norm_w=nw, aux0=st1, aux1=cw,
             conv_n=conv_n, kc=kc, block_n=16, block_k=32, prefetch=prefetch)
        assert rel(y[j], y1) < SAME, j
        assert rel(window[:, j + 1:j + kc], st1) < SAME, j  # the state after token j, as M = 1 leaves it


@MS
@PREFETCH
def test_rmsnorm_argmax_partials(m, prefetch):
    """lm_head: fp32 logits per row and per-program (max, argmax) partials [m, P] (row stride P); rows
    5 and 9 of W are equal and give every row's largest logit: ties go to the lowest index."""
    g = torch.Generator().manual_seed(17)
    k, n, bn = 64, 300, 32
    x = rows(torch.randn(m, k, generator=g).to(BF), m)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    w = (torch.randn(n, k, generator=g) * 0.3).to(BF)
    w[5] = w[9] = (rms1p(x, nw).float().sum(0) * 0.3).to(BF)  # the largest logit of every row
    npart = -(-n // bn)
    logits = nan_rows(m, n, torch.float32)
    pmax = torch.full((m, npart), float("nan"))
    pidx = torch.full((m, npart), -1, dtype=torch.int32)
    p = call(gemv.gemv, x, w, logits, pro=gemv.PRO_RMSNORM, epi=gemv.EPI_ARGMAX, norm_w=nw, aux0=pmax, aux1=pidx,
             block_n=bn, block_k=32, prefetch=prefetch, m=m)
    assert p == npart
    ref = lin(rms1p(x, nw), w).float()
    for j in range(m):
        assert rel(logits[j], ref[j]) < REF, j
        lg1 = nan_like(torch.empty(n))
        pm1, pi1 = torch.empty(npart), torch.empty(npart, dtype=torch.int32)
        call(gemv.gemv, x[j], w, lg1, pro=gemv.PRO_RMSNORM, epi=gemv.EPI_ARGMAX, norm_w=nw, aux0=pm1, aux1=pi1,
             block_n=bn, block_k=32, prefetch=prefetch)
        assert rel(logits[j], lg1) < SAME, j
        # the partials are those of row j's own logits: max and its lowest index per program
        blocks = logits[j].view(-1)[:n]
        for q in range(npart):
            blk = blocks[q * bn:(q + 1) * bn]
            assert float(pmax[j, q]) == float(blk.max()) and int(pidx[j, q]) == q * bn + int(torch.argmax(blk)), (j, q)
        tok = torch.zeros(1, dtype=torch.int64)
        call(sampling.finish, pmax[j], pidx[j], npart, tok, torch.tensor([3]), torch.tensor([0]),
             torch.full((4,), -1, dtype=torch.int64), 4)
        assert int(tok) == int(torch.argmax(logits[j])) == int(torch.argmax(lg1)) == 5


@MS
@PREFETCH
def test_router_store_xn(m, prefetch):
    """The MoE router launch: RMSNorm prologue, the E+1 logits per row, and xn_out [m, K] the normed
    rows (program 0 stores them, from the head blocks and the loop)."""
    g = torch.Generator().manual_seed(18)
    k, e = 96, 17
    res = rows(torch.randn(m, k, generator=g).to(BF), m)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    wr = (torch.randn(e, k, generator=g) * 0.3).to(BF)
    lg = nan_rows(m, e)
    xn = nan_rows(m, k)
    call(gemv.gemv, res, wr, lg, pro=gemv.PRO_RMSNORM, norm_w=nw, xn_out=xn, block_n=8, block_k=32,
         prefetch=prefetch, m=m)
    h = rms1p(res, nw)
    assert torch.equal(xn, h)
    assert rel(lg, lin(h, wr)) < REF
    for j in range(m):
        lg1, xn1 = nan_like(torch.empty(e, dtype=BF)), nan_like(torch.empty(k, dtype=BF))
        call(gemv.gemv, res[j], wr, lg1, pro=gemv.PRO_RMSNORM, norm_w=nw, xn_out=xn1, block_n=8, block_k=32,
             prefetch=prefetch)
        assert torch.equal(xn[j], xn1)
        assert rel(lg[j], lg1) < SAME, j


def test_m_rows_rejects_bad_shapes():
    w8 = cat_rows([quantize_weight(torch.randn(40, 64), (8, 64)), torch.zeros(8, 64, dtype=BF)])
    x, y = torch.zeros(2, 64, dtype=BF), torch.zeros(2, 48, dtype=BF)
    with pytest.raises(ValueError, match="prefetch and l2 are for bf16 weights"):
        gemv.gemv(x, w8, y, m=2, prefetch=2)
    with pytest.raises(ValueError, match="40 fp8 rows before the bf16 tail are not a multiple of block_n 16"):
        gemv.gemv(x, w8, y, m=2, block_n=16)
    y = torch.zeros(2, 32, dtype=BF)
    w = torch.zeros(32, 64, dtype=BF)
    with pytest.raises(ValueError, match="m must be 1..8"):
        gemv.gemv(torch.zeros(9, 64, dtype=BF), w, torch.zeros(9, 32, dtype=BF), m=9, dot=0)
    with pytest.raises(ValueError, match=r"1..32 on the tensor-core kernel"):
        gemv.gemv(torch.zeros(33, 64, dtype=BF), w, torch.zeros(33, 32, dtype=BF), m=33, dot=2, block_n=16)
    with pytest.raises(ValueError, match="block_n and block_k >= 16"):
        gemv.gemv(x, w, y, m=2, dot=2, block_n=8)
    with pytest.raises(ValueError, match="window"):
        gemv.gemv(x, w, y, epi=gemv.EPI_CONV, aux0=torch.zeros(16, 3, dtype=BF), aux1=torch.zeros(16, 4, dtype=BF),
                  conv_n=16, m=2)


@pytest.mark.parametrize("m", [12, 32])  # the batched speculative round: B slots x M positions, up to 32
def test_tensor_core_rows_past_eight(m):
    """The tensor-core M-row kernel past the fold's 8 rows: every row equals the one-row GEMV's (rmsnorm
    prologue, argmax partials), the rows independent of each other."""
    g = torch.Generator().manual_seed(13)
    k, n = 96, 70
    x = rows(torch.randn(m, k, generator=g).to(BF), m)
    w = (torch.randn(n, k, generator=g) * 0.1).to(BF)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    y = nan_rows(m, n)
    gemv.gemv(x, w, y, pro=gemv.PRO_RMSNORM, norm_w=nw, block_n=16, block_k=32, m=m, dot=2)
    assert not y.isnan().any()
    for j in range(m):
        y1 = nan_like(torch.empty(n, dtype=BF))
        gemv.gemv(x[j], w, y1, pro=gemv.PRO_RMSNORM, norm_w=nw, block_n=16, block_k=32)
        assert rel(y[j], y1) < SAME, j


def epilogue_case(m: int, k: int, epi: str, seed: int):
    """x [m, k] and W of n = 48 outputs (three tiles of 16 rows; 2n for SwiGLU), and `launch(**kw)`: one
    tensor-core M-row launch (RMSNorm prologue, K blocks of 32) with the epilogue `epi` ("swiglu", "residual",
    "argmax", "conv": every epilogue the verify launches) into poisoned outputs, returned by name."""
    g = torch.Generator().manual_seed(seed)
    n, conv_n = 48, 32
    x = rows(torch.randn(m, k, generator=g).to(BF), m)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    w = (torch.randn(2 * n if epi == "swiglu" else n, k, generator=g) * 0.1).to(BF)
    res0 = rows(torch.randn(m, n, generator=g).to(BF), m)
    st, cw = torch.randn(conv_n, 3, generator=g).to(BF), (torch.randn(conv_n, 4, generator=g) * 0.5).to(BF)

    def launch(**extra):
        kw = {"pro": gemv.PRO_RMSNORM, "norm_w": nw, "block_n": 16, "block_k": 32, "m": m, "dot": 2, **extra}
        out = {"y": nan_rows(m, n, torch.float32 if epi == "argmax" else BF)}
        if epi == "swiglu":
            kw["epi"] = gemv.EPI_SWIGLU
        elif epi == "residual":
            out["y"], kw["epi"] = res0.clone(), gemv.EPI_RESIDUAL
        elif epi == "argmax":
            out["pmax"], out["pidx"] = torch.full((m, 3), float("nan")), torch.full((m, 3), -1, dtype=torch.int32)
            kw.update(epi=gemv.EPI_ARGMAX, aux0=out["pmax"], aux1=out["pidx"])
        else:
            out["win"] = torch.full((conv_n, 3 + m), float("nan"), dtype=BF)
            kw.update(epi=gemv.EPI_CONV, aux0=st, aux1=cw, conv_n=conv_n, kc=4, window=out["win"])
        call(gemv.gemv, x, w, out["y"], **kw)
        return out

    return x, w, n, launch


@pytest.mark.parametrize("m", [4, 12])
@pytest.mark.parametrize("splits", [2, 3])  # 3: K's 5 blocks split 2 + 2 + 1
@pytest.mark.parametrize("epi", ["swiglu", "residual", "argmax", "conv"])
def test_split_k_equals_one_split(m, splits, epi):
    """K over `splits` programs per output tile (`splits`, the tensor-core kernel): the tile's last program
    sums the partials in split order and runs the epilogue. Outputs equal the one-split launch's to the
    summation order (SwiGLU, residual add, lm_head partials, the conv window: every epilogue the verify
    launches); a second launch over the same scratch gives the same bytes (the arrival counters were left
    at 0); more splits than K blocks run one block a split."""
    k = 160  # 5 K blocks of 32
    x, w, n, launch = epilogue_case(m, k, epi, seed=21)
    one, split = launch(splits=1), launch(splits=splits)
    for name in one:
        assert not split[name].isnan().any(), name
        if name == "pidx":
            assert torch.equal(split[name], one[name])
        else:
            assert rel(split[name], one[name]) < SAME, name
    again = launch(splits=splits)
    for name in split:
        assert torch.equal(again[name], split[name]), name
    if DEV == "cpu":  # the scratch: counters back at 0; the logits are the partials' sums in split order
        part, cnt = gemv.splitk_workspace(torch.device("cpu"), 0, 0)
        assert not cnt.any()
        if epi == "argmax":
            mp = 1 << (m - 1).bit_length()
            p = part[:splits * 3 * mp * 16].view(splits, 3, mp, 16)[:, :, :m].permute(0, 2, 1, 3).reshape(splits, m, n)
            total = p[0].clone()
            for q in range(1, splits):
                total += p[q]
            assert torch.equal(split["y"], total.to(BF).float())  # EPI_ARGMAX stores bf16-rounded logits
    capped = nan_rows(m, n)  # more splits than K blocks: one block a split
    call(gemv.gemv, x, w[:n], capped, m=m, dot=2, block_n=16, block_k=32, splits=9)
    assert rel(capped, lin(x, w[:n])) < REF
    with pytest.raises(ValueError, match="splits must be >= 1"):
        gemv.gemv(x, w[:n], nan_rows(m, n), m=m, dot=2, block_n=16, block_k=32, splits=0)
    with pytest.raises(ValueError, match="splits needs the tensor-core"):
        gemv.gemv(x[:2], w[:n], nan_rows(2, n), m=2, dot=0, block_n=16, block_k=32, splits=2)


def fp8_weight(n: int, k: int, block, seed: int, halves: bool = False, tail: int = 0):
    """An FP8Weight [n (+ tail), k]: one checkpoint tensor, or with `halves` a SwiGLU [gate; up] whose halves
    keep grids of their own, and `tail` bf16 rows after the fp8 ones (the GDN in_proj's b / a)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n + tail, k, generator=g) * 0.2
    q = quantize_weight(w[:n], block, (n // 2, n // 2) if halves else None)
    return cat_rows([q, w[n:].to(BF)]) if tail else q


FP8_BLOCKS = pytest.mark.parametrize("block", [(32, 32), (24, 40)], ids=["shared", "straddled"])


def one_row_round_w(kernel: int, block, block_k: int, round_w: bool) -> bool:
    """The one-row fp8 kernel's `round_w` whose products an M-row launch's equal: the tensor-core kernel rounds each
    e4m3 * scale to bf16 where its K blocks straddle the scale blocks."""
    return round_w or (kernel > 0 and block[1] % block_k != 0)


@pytest.mark.parametrize("m", [3, 4])
@FP8_BLOCKS
@pytest.mark.parametrize("round_w", [False, True])
@pytest.mark.parametrize("epi", ["store_xn", "swiglu", "residual"])
def test_fp8_rows_equal_the_one_row_fp8_kernel(kernel, m, block, round_w, epi):
    g = torch.Generator().manual_seed(21)
    k, n = 96, 64
    x = rows(torch.randn(m, k, generator=g).to(BF), m)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    w = fp8_weight(2 * n if epi == "swiglu" else n, k, block, seed=22, halves=epi == "swiglu")
    wd = w.dequant(BF)
    kw = dict(block_n=16, block_k=32)
    if epi == "store_xn":
        kw.update(pro=gemv.PRO_RMSNORM, norm_w=nw)
        y, xn = nan_rows(m, n), nan_rows(m, k)
        call(gemv.gemv, x, w, y, xn_out=xn, round_w=round_w, m=m, **kw)
        ref = lin(rms1p(x, nw), wd)
        assert torch.equal(xn, rms1p(x, nw))
    elif epi == "swiglu":
        kw.update(pro=gemv.PRO_RMSNORM, epi=gemv.EPI_SWIGLU, norm_w=nw)
        y = nan_rows(m, n)
        call(gemv.gemv, x, w, y, round_w=round_w, m=m, **kw)
        h = rms1p(x, nw)
        ref = F.silu(lin(h, wd[:n])) * lin(h, wd[n:])
    else:
        kw.update(epi=gemv.EPI_RESIDUAL)
        res0 = rows(torch.randn(m, n, generator=g).to(BF), m)
        y = res0.clone()
        call(gemv.gemv, x, w, y, round_w=round_w, m=m, **kw)
        ref = res0 + lin(x, wd)
    assert not y.isnan().any()
    for j in range(m):
        y1 = res0[j].clone() if epi == "residual" else nan_like(torch.empty(n, dtype=BF))
        call(gemv.gemv, x[j], w, y1, round_w=one_row_round_w(kernel, block, kw["block_k"], round_w), **kw)
        assert rel(y[j], y1) < SAME, j
        assert rel(y[j], ref[j]) < REF, j


@pytest.mark.parametrize("m", [3, 4])
@FP8_BLOCKS
def test_fp8_conv_window_with_a_bf16_tail(kernel, m, block):
    """The GDN in_proj of an FP8 checkpoint: fp8 rows (the conv channels and z), then bf16 tail rows (b / a),
    each program reading one of the two; row j equals the one-row fp8 kernel run token by token."""
    g = torch.Generator().manual_seed(23)
    conv_n, z_n, tail, kc, k = 32, 16, 16, 4, 64
    x = rows(torch.randn(m, k, generator=g).to(BF), m)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    w = fp8_weight(conv_n + z_n, k, block, seed=24, tail=tail)
    cw = (torch.randn(conv_n, kc, generator=g) * 0.5).to(BF)
    st0 = torch.randn(conv_n, kc - 1, generator=g).to(BF)
    st = st0.clone()
    window = torch.full((conv_n, kc - 1 + m), float("nan"), dtype=BF)
    n = conv_n + z_n + tail
    y = nan_rows(m, n)
    kw = dict(pro=gemv.PRO_RMSNORM, epi=gemv.EPI_CONV, norm_w=nw, aux1=cw, conv_n=conv_n, kc=kc, block_n=16,
              block_k=32)
    call(gemv.gemv, x, w, y, aux0=st, m=m, window=window, **kw)
    assert torch.equal(st, st0) and not y.isnan().any()
    proj = lin(rms1p(x, nw), w.dequant(BF))
    assert rel(y[:, conv_n:], proj[:, conv_n:]) < REF
    st1 = st0.clone()
    for j in range(m):
        y1 = nan_like(torch.empty(n, dtype=BF))
        call(gemv.gemv, x[j], w, y1, aux0=st1, round_w=one_row_round_w(kernel, block, kw["block_k"], False), **kw)
        assert rel(y[j], y1) < SAME, j
        assert rel(window[:, j + 1:j + kc], st1) < SAME, j
