"""Each decode kernel against the eager op it replaces, on random inputs.

On CPU (CI) the Triton interpreter runs the same kernel source with numpy, so the math (indexing,
masking, rounding points, the in-place state updates) is checked without a GPU. With
NEXRT_KERNEL_DEVICE=cuda (benchmarks/checks/gpu_check.py on the H200) the same tests run the compiled
kernels. Outputs are poisoned (NaN) before each launch so an unwritten element fails the comparison.
"""
import pytest
import torch
import torch.nn.functional as F

from nexrt_vllm.engine import kernels
from nexrt_vllm.testing.kernel_calls import DEV, call, rel, rms1p, to_dev

attention, gdn, gemv, moe, sampling, *_ = kernels.load(interpret=DEV == "cpu")

torch.set_num_threads(1)
BF = torch.bfloat16


def lin(x, w):  # bf16 linear with fp32 accumulation, as a GPU GEMM
    return (w.float() @ x.float()).to(x.dtype)


def nan_like(t):
    return torch.full_like(t, float("nan"))


# prefetch: K blocks each program loads before it waits on the previous kernel (head, then the loop)
PREFETCH = pytest.mark.parametrize("prefetch", [0, 2])


@PREFETCH
@pytest.mark.parametrize("k,block_k", [(96, 32), (8200, 1024)])  # x in one load / K > 8192: looped
def test_gemv_rmsnorm_prologue_store(k, block_k, prefetch):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(k, generator=g).to(BF)
    w = (torch.randn(70, k, generator=g) * 0.1).to(BF)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    y = nan_like(torch.empty(70, dtype=BF))
    call(gemv.gemv, x, w, y, pro=gemv.PRO_RMSNORM, norm_w=nw, block_n=16, block_k=block_k, prefetch=prefetch)
    ref = lin(rms1p(x, nw), w)
    assert rel(y, ref) < 8e-3 and not y.isnan().any()


@pytest.mark.parametrize("prefetch", [0, 1, 2])  # 2: the head is all of K, the loop runs no block
def test_gemv_residual_and_swiglu_epilogues(prefetch):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, generator=g).to(BF)
    wgu = (torch.randn(2 * 40, 64, generator=g) * 0.2).to(BF)
    act = nan_like(torch.empty(40, dtype=BF))
    call(gemv.gemv, x, wgu, act, epi=gemv.EPI_SWIGLU, block_n=16, block_k=32, prefetch=prefetch)
    gate, up = lin(x, wgu[:40]), lin(x, wgu[40:])
    ref = F.silu(gate) * up
    assert rel(act, ref) < 8e-3 and not act.isnan().any()
    res = torch.randn(50, generator=g).to(BF)
    wd = (torch.randn(50, 40, generator=g) * 0.2).to(BF)
    ref_res = res + lin(act, wd)
    call(gemv.gemv, act, wd, res, epi=gemv.EPI_RESIDUAL, block_n=16, block_k=32, prefetch=prefetch)
    assert rel(res, ref_res) < 8e-3


@PREFETCH
def test_gemv_conv_epilogue_updates_state(prefetch):
    g = torch.Generator().manual_seed(3)
    conv_n, extra, kc = 48, 20, 4
    x = torch.randn(64, generator=g).to(BF)
    w = (torch.randn(conv_n + extra, 64, generator=g) * 0.2).to(BF)
    cw = (torch.randn(conv_n, kc, generator=g) * 0.5).to(BF)
    st = torch.randn(conv_n, kc - 1, generator=g).to(BF)
    st_ref = st.clone()
    y = nan_like(torch.empty(conv_n + extra, dtype=BF))
    call(gemv.gemv, x, w, y, epi=gemv.EPI_CONV, aux0=st, aux1=cw, conv_n=conv_n, kc=kc, block_n=16, block_k=32,
         prefetch=prefetch)
    proj = lin(x, w)
    window = torch.cat([st_ref, proj[:conv_n, None]], 1)  # oldest first, newest last
    conv = (window.float() * cw.float()).sum(1).to(BF)
    assert rel(y[:conv_n], F.silu(conv)) < 8e-3
    assert torch.equal(y[conv_n:], proj[conv_n:]) or rel(y[conv_n:], proj[conv_n:]) < 8e-3
    assert torch.equal(st[:, :-1], st_ref[:, 1:])
    assert rel(st[:, -1], proj[:conv_n]) < 8e-3


@PREFETCH
@pytest.mark.parametrize("block_k", [32, 64])  # one head, two heads per K block
def test_gemv_gated_norm_prologue(block_k, prefetch):
    g = torch.Generator().manual_seed(4)
    heads, dv, n = 4, 32, 24
    o = torch.randn(heads * dv, generator=g).to(BF)
    z = torch.randn(heads * dv, generator=g).to(BF)
    nw = (1 + 0.1 * torch.randn(dv, generator=g)).to(BF)
    w = (torch.randn(n, heads * dv, generator=g) * 0.2).to(BF)
    res = torch.randn(n, generator=g).to(BF)
    oh = o.view(heads, dv).float()
    normed = (oh * torch.rsqrt(oh.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF)
    gated = ((nw * normed).float() * F.silu(z.view(heads, dv).float())).to(BF).view(-1)
    ref = res + lin(gated, w)
    call(gemv.gemv, o, w, res, pro=gemv.PRO_GATED, epi=gemv.EPI_RESIDUAL, norm_w=nw, z=z, group=dv, block_n=8,
         block_k=block_k, prefetch=prefetch)
    assert rel(res, ref) < 8e-3


@PREFETCH
def test_gemv_argmax_epilogue_partials(prefetch):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, generator=g).to(BF)
    w = (torch.randn(300, 64, generator=g) * 0.3).to(BF)
    logits = nan_like(torch.empty(300))
    npart = -(-300 // 32)
    pmax, pidx = torch.empty(npart), torch.empty(npart, dtype=torch.int32)
    call(gemv.gemv, x, w, logits, epi=gemv.EPI_ARGMAX, aux0=pmax, aux1=pidx, block_n=32, block_k=32, prefetch=prefetch)
    ref = lin(x, w).float()
    assert rel(logits, ref) < 8e-3
    tok, pos, step = torch.zeros(1, dtype=torch.int64), torch.tensor([7]), torch.tensor([41])
    ring = torch.full((4,), -1, dtype=torch.int64)
    call(sampling.finish, pmax, pidx, npart, tok, pos, step, ring, 4)
    assert int(tok) == int(torch.argmax(logits)) and int(pos) == 8 and int(step) == 42
    assert int(ring[41 % 4]) == (42 << 32) | int(tok) and int((ring == -1).sum()) == 3


def _gdn_ref(qkv, b, a, a_log, dt_bias, S, hk, hv, dk, dv):
    kd = hk * dk
    q, k, v = qkv[:kd].view(hk, dk), qkv[kd:2 * kd].view(hk, dk), qkv[2 * kd:].view(hv, dv)
    r = hv // hk
    q, k = q.repeat_interleave(r, 0).float(), k.repeat_interleave(r, 0).float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / dk ** 0.5
    beta = b.sigmoid().float()
    gg = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    S = S * gg.exp()[:, None, None]
    kv = (S * k[:, :, None]).sum(1)
    delta = (v.float() - kv) * beta[:, None]
    S = S + k[:, :, None] * delta[:, None, :]
    return (S * q[:, :, None]).sum(1).to(BF).reshape(-1), S


@pytest.mark.parametrize("prefetch", [False, True])  # the state slice read before the PDL wait
@pytest.mark.parametrize("warps", [4, 1])  # one warp: the default on the GPU (Tuning.gdn_warps)
@pytest.mark.parametrize("hk,hv", [(2, 4), (2, 2)])
def test_gdn_step_matches_delta_rule(hk, hv, warps, prefetch):
    g = torch.Generator().manual_seed(6)
    dk = dv = 32
    kd, vd = hk * dk, hv * dv
    buf = torch.randn(2 * kd + 2 * vd + 2 * hv, generator=g).to(BF)
    S = torch.randn(hv, dk, dv, generator=g)
    a_log = (torch.rand(hv, generator=g) * 15 + 1).log().to(BF)
    dt_bias = torch.ones(hv, dtype=BF)
    off_b = 2 * kd + 2 * vd
    o_ref, S_ref = _gdn_ref(buf[:2 * kd + vd], buf[off_b:off_b + hv], buf[off_b + hv:], a_log, dt_bias, S.clone(),
                            hk, hv, dk, dv)
    out = nan_like(torch.empty(vd, dtype=BF))
    call(gdn.gdn_step, buf, S, out, a_log, dt_bias, num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv,
         block_v=16, num_warps=warps, prefetch=prefetch)
    assert rel(S, S_ref) < 1e-5
    assert rel(out, o_ref) < 8e-3


def test_gdn_decay_softplus_small_gates():
    """The decay exp(-A softplus(a + dt_bias)) for gates from far below 0 to past the threshold:
    softplus must follow torch's log1p(exp(x)) (log(1 + exp(x)) is up to 2 % off for x < -10). With
    k = 0 the step is the decay alone: S' = exp(g) S."""
    hv, dk, dv = 16, 16, 16
    g = torch.Generator().manual_seed(9)
    kd, vd = hv * dk, hv * dv
    buf = torch.randn(2 * kd + 2 * vd + 2 * hv, generator=g).to(BF)
    buf[kd:2 * kd] = 0
    off_b = 2 * kd + 2 * vd
    buf[off_b + hv:] = torch.linspace(-18, 25, hv).to(BF)
    S = torch.randn(hv, dk, dv, generator=g)
    a_log = torch.full((hv,), 1000.0).log().to(BF)
    dt_bias = torch.zeros(hv, dtype=BF)
    decay = (-a_log.float().exp() * F.softplus(buf[off_b + hv:].float())).exp()
    S0 = S.clone()
    S_ref = S * decay[:, None, None]
    call(gdn.gdn_step, buf, S, nan_like(torch.empty(vd, dtype=BF)), a_log, dt_bias, num_k_heads=hv, num_v_heads=hv,
         head_k_dim=dk, head_v_dim=dv, block_v=16)
    assert float(((S - S_ref) / S0).abs().max()) < 1e-6  # relative to the state before the step


def _rope_ref(x, pos, inv_freq, rot):
    ang = pos * inv_freq
    emb = torch.cat([ang, ang])
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr[..., :rot // 2], xr[..., rot // 2:]
    return torch.cat([xr * cos + torch.cat([-x2, x1], -1) * sin, xp], -1)


def test_qk_rope_cache_and_split_attention():
    g = torch.Generator().manual_seed(7)
    H, KVH, hd, rot, maxlen, pos = 4, 2, 64, 16, 80, 57
    qkv = torch.randn(H * 2 * hd + 2 * KVH * hd, generator=g).to(BF)
    qn, kn = (0.1 * torch.randn(hd, generator=g)).to(BF), (0.1 * torch.randn(hd, generator=g)).to(BF)
    kc = torch.randn(KVH, maxlen, hd, generator=g).to(BF)
    vc = torch.randn(KVH, maxlen, hd, generator=g).to(BF)
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rot, 2).float() / rot))
    ang = torch.arange(maxlen).float()[:, None] * inv_freq
    cos_t, sin_t = torch.cat([ang, ang], 1).cos().to(BF), torch.cat([ang, ang], 1).sin().to(BF)
    posb = torch.tensor([pos])
    q_out = nan_like(torch.empty(H * hd, dtype=BF))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    call(attention.qk_rope_cache, qkv, q_out, kc, vc, qn, kn, cos_t, sin_t, posb, num_heads=H, num_kv_heads=KVH,
         head_dim=hd, rotary_dim=rot, eps=1e-6)
    qg = qkv[:H * 2 * hd].view(H, 2, hd)
    q_ref = _rope_ref(rms1p(qg[:, 0], qn), pos, inv_freq, rot)
    k_new = qkv[H * 2 * hd:H * 2 * hd + KVH * hd].view(KVH, hd)
    kc_ref[:, pos] = _rope_ref(rms1p(k_new, kn), pos, inv_freq, rot)
    vc_ref[:, pos] = qkv[H * 2 * hd + KVH * hd:].view(KVH, hd)
    assert rel(q_out.view(H, hd), q_ref) < 8e-3
    assert rel(kc[:, pos], kc_ref[:, pos]) < 8e-3 and torch.equal(vc, vc_ref)
    assert torch.equal(kc[:, :pos], kc_ref[:, :pos])
    kk = kc[:, :pos + 1].repeat_interleave(H // KVH, 0)
    vv = vc[:, :pos + 1].repeat_interleave(H // KVH, 0)
    scores = (q_out.view(H, 1, hd) @ kk.transpose(1, 2)) * hd ** -0.5  # bf16, as the eager model
    p = torch.softmax(scores, -1, dtype=torch.float32).to(BF)
    ref = (p @ vv).view(H, hd) * torch.sigmoid(qg[:, 1])
    nsplit = 4
    # min_per -> live splits of the 58 keys: 16 keys each: 4; 32: 2; 128: 1 (short context)
    for min_per, live in ((16, 4), (32, 2), (128, 1)):
        m_b, l_b = nan_like(torch.empty(H * nsplit)), nan_like(torch.empty(H * nsplit))
        acc_b = nan_like(torch.empty(H * nsplit * hd))
        s_b = nan_like(torch.empty(H * maxlen))
        out = nan_like(torch.empty(H * hd, dtype=BF))
        call(attention.attention_decode, q_out, kc, vc, posb, qkv, out, m_b, l_b, acc_b, s_b, num_heads=H,
             num_kv_heads=KVH, head_dim=hd, nsplit=nsplit, block=16, min_per=min_per)
        # probabilities normalised and rounded to bf16 as the eager softmax leaves them: equal up to fp32
        # accumulation order and the device exp (bit-equal in the interpreter)
        assert rel(out.view(H, hd), ref) < 2e-3, min_per
        # the splits past the end wrote nothing
        assert m_b.view(H, nsplit).isfinite().sum(1).tolist() == [live] * H, min_per
        assert m_b.view(H, nsplit)[:, live:].isnan().all() and acc_b.view(H, nsplit, hd)[:, live:].isnan().all()


def test_gather_rows_copies_the_indexed_rows():
    """The step's embedding (one row into a vector), the batch step's (zeros for a slot that is not live) and the
    verify's (rows of a table by token id), each slot's row of its accepted position in a round (row b * M + acc[b];
    acc < 0, a round that emitted nothing: row b * M): bit for bit; columns past H are left alone."""
    table = torch.randn(50, 40).to(BF)
    out = nan_like(torch.empty(40, dtype=BF))
    call(sampling.gather_rows, torch.tensor([37]), table, out)
    assert torch.equal(out, table[37])
    g = torch.Generator().manual_seed(4)
    H, V, M = 1300, 40, 4  # H past one 1024-column block
    emb = torch.randn(V, H, generator=g).to(BF)
    tok = torch.tensor([7, 39, 0, 7])
    out = torch.full((M, H + 3), float("nan"), dtype=BF)
    call(sampling.gather_rows, tok, emb, out)
    assert torch.equal(out[:, :H], emb[tok]) and out[:, H:].isnan().all()
    live = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    call(sampling.gather_rows, tok, emb, out, live=live)
    assert torch.equal(out[::2, :H], emb[tok[::2]]) and (out[1::2, :H] == 0).all()
    u = torch.randn(3 * M, H, generator=g).to(BF)
    acc = torch.tensor([2, -1, 3])
    u1 = torch.zeros(3, H, dtype=BF)
    call(sampling.gather_rows, acc, u, u1, step=M)
    assert torch.equal(u1, u[torch.tensor([2, M, 2 * M + 3])])
    with pytest.raises(ValueError, match="gather_rows"):
        sampling.gather_rows(tok, emb, torch.zeros(M - 1, H, dtype=BF))


# (rows gate_up, rows down, warps); the GPU default; a shared expert as wide as the routed ones, every
# width a multiple of the blocks (the kernels' unmasked variants)
@pytest.mark.parametrize("shape", [(16, 8, 4), (2, 1, 1), (16, 8, 4, 32)])
@pytest.mark.parametrize("topk", [4, 3])  # the down launch gathers a power-of-two slot tile, masked
def test_moe_experts_selected_only(topk, shape):
    bn, dbn, nw, inter_s = (*shape, 48)[:4]
    g = torch.Generator().manual_seed(8)
    E, hid, inter = 16, 64, 32
    res = torch.randn(hid, generator=g).to(BF)
    norm_w = (0.1 * torch.randn(hid, generator=g)).to(BF)  # not `nw`: that is the warps
    wr = (torch.randn(E + 1, hid, generator=g) * 0.3).to(BF)
    gu = (torch.randn(E, 2 * inter, hid, generator=g) * 0.2).to(BF)
    dn = (torch.randn(E, hid, inter, generator=g) * 0.2).to(BF)
    sgu = (torch.randn(2 * inter_s, hid, generator=g) * 0.2).to(BF)
    sdn = (torch.randn(hid, inter_s, generator=g) * 0.2).to(BF)
    h = rms1p(res, norm_w)
    logits = lin(h, wr)
    probs = torch.softmax(logits[:E].float(), -1)
    top_v, top_i = torch.topk(probs, topk)
    top_v = (top_v / top_v.sum()).to(BF)
    out = torch.zeros(hid, dtype=BF)
    for e in sorted(top_i.tolist()):
        gg, uu = lin(h, gu[e]).chunk(2)
        y = lin(F.silu(gg) * uu, dn[e]) * top_v[top_i.tolist().index(e)]
        out = out + y
    sg, su = lin(h, sgu).chunk(2)
    shared = torch.sigmoid(logits[E:]) * lin(F.silu(sg) * su, sdn)
    ref = res + (out + shared)
    res_start = res.clone()
    lg = nan_like(torch.empty(E + 1, dtype=BF))
    ids, wts = torch.full((topk,), -1, dtype=torch.int32), nan_like(torch.empty(topk))
    xn = nan_like(torch.empty(hid, dtype=BF))
    # prefetch 1: the normed input is stored from the head block and from the loop
    call(gemv.gemv, res, wr, lg, pro=gemv.PRO_RMSNORM, norm_w=norm_w, xn_out=xn, block_n=8, block_k=32, prefetch=1)
    assert torch.equal(xn, h)
    act = nan_like(torch.empty((topk + 1) * inter_s, dtype=BF))
    # the gate_up launch routes from the logits and publishes ids (ascending) / weights for the down launch
    call(moe.moe_experts, xn, res, lg, gu, sgu, dn, sdn, act, ids, wts, top_k=topk, block_n=bn, block_k=32,
         down_block_n=dbn, down_block_k=16, num_warps=nw, down_num_warps=nw)
    assert ids.tolist() == sorted(top_i.tolist())
    assert torch.equal(wts, top_v[[top_i.tolist().index(e) for e in ids.tolist()]].float())
    d = lambda x: x.float() - res_start.float()  # noqa: E731 - the MoE's contribution, not the residual
    assert rel(d(res), d(ref)) < 2e-2, rel(d(res), d(ref))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_moe_experts_rows_equal_one_row_launches(fmt):
    """The verify's M rows in one gate_up + one down launch leave exactly what M one-row launches leave:
    residual rows, ids, weights and act rows (rows 0 and 2 share a routing, so experts repeat). The
    widths divide the blocks here (the kernels' unmasked variants; the test above has the masked ones)."""
    from nexrt_vllm.engine.fp8 import quantize_weight

    g = torch.Generator().manual_seed(11)
    E, hid, inter, inter_s, topk, m = 16, 64, 32, 32, 4, 3
    w8 = lambda *s: (torch.randn(*s, generator=g) * 0.2)  # noqa: E731
    q = (lambda w: quantize_weight(w, (16, 32))) if fmt == "fp8" else (lambda w: w.to(BF))  # noqa: E731
    gu, dn, sgu, sdn = q(w8(E, 2 * inter, hid)), q(w8(E, hid, inter)), q(w8(2 * inter_s, hid)), q(w8(hid, inter_s))
    xn = torch.randn(m, hid, generator=g).to(BF)
    lg = torch.randn(m, E + 1, generator=g).to(BF)
    lg[2], xn[2] = lg[0], xn[0] + 1  # the same experts, other inputs
    res0 = torch.randn(m, hid, generator=g).to(BF)
    shape = dict(top_k=topk, block_n=8, block_k=32, down_block_n=4, down_block_k=16, num_warps=4, down_num_warps=4)

    def bufs():
        return (res0.clone(), nan_like(torch.empty(m, (topk + 1) * inter_s, dtype=BF)),
                torch.full((m, topk), -1, dtype=torch.int32), nan_like(torch.empty(m, topk)))

    res1, act1, ids1, wts1 = bufs()
    for j in range(m):
        call(moe.moe_experts, xn[j], res1[j], lg[j], gu, sgu, dn, sdn, act1[j], ids1[j], wts1[j], **shape)
    res, act, ids, wts = bufs()
    call(moe.moe_experts, xn, res, lg, gu, sgu, dn, sdn, act, ids, wts, **shape)
    assert torch.equal(ids, ids1) and ids[0].tolist() == ids[2].tolist()
    assert torch.equal(wts, wts1) and torch.equal(res, res1)
    torch.testing.assert_close(act, act1, rtol=0, atol=0, equal_nan=True)  # routed slots leave I..IMAX unwritten
    assert not torch.equal(res[0], res0[0])


def test_gumbel_sampling_respects_top_k_and_top_p():
    torch.manual_seed(9)
    V = 50
    logits = torch.randn(V) * 2
    params = torch.tensor([0.7, 0.6, 5.0])
    vals, idx = torch.sort(logits, descending=True)
    probs = torch.softmax(vals / params[0], 0)
    cum = (torch.cumsum(probs, 0) - probs) / probs[:5].sum()  # top-p mass within the top-k set
    allowed = set(idx[:5][(cum[:5] < 0.6) | (torch.arange(5) == 0)].tolist())
    draws = []
    for position in list(range(40)) + [5]:  # noise is keyed on (seed, position): position 5 again
        pmax, pidx = torch.empty(2), torch.empty(2, dtype=torch.int32)
        n = call(sampling.gumbel_partial, vals, idx, cum, params, torch.tensor([3]), torch.tensor([position]), pmax,
                 pidx, block=32)
        tok, pos, stp = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.zeros(1)
        call(sampling.finish, pmax, pidx, n, tok, pos, stp.long(), torch.zeros(4, dtype=torch.int64), 4)
        draws.append(int(tok))
    assert set(draws) <= allowed and len(set(draws)) > 1
    assert draws[-1] == draws[5]


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_l2_prefetch_leaves_the_same_bytes(fmt):
    """Tuning.l2_prefetch: a GEMV over bf16 weights asking L2 for the next weight's first bytes (bf16,
    or an fp8 weight's e4m3 values; one segment, or a SwiGLU weight's two halves; more bytes than the
    weight holds are cut to it) leaves exactly the bytes it leaves without. A GEMV over fp8 weights
    asks for nothing."""
    from nexrt_vllm.engine.fp8 import quantize_weight

    g = torch.Generator().manual_seed(21)
    q = (lambda w, parts=None: quantize_weight(w, (128, 128), parts)) if fmt == "fp8" else (lambda w, parts=None: w)
    x = torch.randn(256, generator=g).to(BF)
    w = (torch.randn(96, 256, generator=g) * 0.1).to(BF)
    nxt = to_dev(q((torch.randn(2 * 64, 256, generator=g) * 0.1).to(BF), (64, 64)))  # only its address is read
    res0 = torch.randn(96, generator=g).to(BF)
    outs = []
    for l2 in (None, gemv.l2_target(nxt, 5000, halves=True), gemv.l2_target(nxt, 1 << 30)):
        y = res0.clone()
        call(gemv.gemv, x, w, y, epi=gemv.EPI_RESIDUAL, block_n=16, block_k=128, l2=l2)
        outs.append(y)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    with pytest.raises(ValueError, match="bf16 weights"):
        gemv.gemv(to_dev(x), to_dev(quantize_weight(w, (128, 128))), to_dev(res0.clone()), epi=gemv.EPI_RESIDUAL,
                  l2=gemv.l2_target(nxt, 5000))
