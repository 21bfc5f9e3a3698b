"""The verify pass's attention and GDN kernels (M new tokens in one pass) against the eager ops.

`Model.verify` runs M tokens at positions pos..pos+M-1: attention writes their K/V rows and row j
attends causally to rows [start, pos+j] (`attention_decode` under a [M, S] `visible` mask); GDN runs
the tokens in order from the live state, keeps the state after each (`gdn_verify`) and `gdn_commit`
makes one of them live. Interpreter on CPU as tests/engine/test_kernels_decode_ops.py, outputs
poisoned with NaN before each launch.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from nexrt_vllm.engine import kernels
from nexrt_vllm.engine import model as eager
from nexrt_vllm.testing.kernel_calls import DEV, call, rel

_K = dict(zip(kernels.MODULES, kernels.load(interpret=DEV == "cpu")))
attention, gdn = _K["attention"], _K["gdn"]

torch.set_num_threads(1)
BF = torch.bfloat16


def nan_like(t):
    return torch.full_like(t, float("nan"))


# ---------------------------------------------------------------------------------------------
# GDN
# ---------------------------------------------------------------------------------------------


def _gdn_inputs(m, hk, hv, dk, dv, seed, pad=3):
    """buf [m, width + pad] (a row stride past the row), the live state and the gates' parameters."""
    g = torch.Generator().manual_seed(seed)
    kd, vd = hk * dk, hv * dv
    width = 2 * kd + 2 * vd + 2 * hv
    buf = torch.randn(m, width + pad, generator=g).to(BF)
    S = torch.randn(hv, dk, dv, generator=g)
    a_log = (torch.rand(hv, generator=g) * 15 + 1).log().to(BF)
    dt_bias = (torch.randn(hv, generator=g) * 0.5).to(BF)
    return buf, S, a_log, dt_bias


def _gdn_verify_ref(buf, S, a_log, dt_bias, hk, hv, dk, dv):
    """`gdn_verify`'s recurrent part on rows already conv'd: (out [m, vd], rec_after [m, hv, dk, dv])."""
    kd, vd, m = hk * dk, hv * dv, buf.shape[0]
    off_b = 2 * kd + 2 * vd
    cfg = SimpleNamespace(key_dim=kd, value_dim=vd, linear_key_head_dim=dk, linear_value_head_dim=dv,
                          linear_num_value_heads=hv, linear_num_key_heads=hk)
    w = SimpleNamespace(A_log=a_log, dt_bias=dt_bias)
    q, k, v = eager._split_heads(buf[:, :2 * kd + vd], cfg)
    beta, gg = eager._gdn_gates(w, buf[:, off_b:off_b + hv], buf[:, off_b + hv:off_b + 2 * hv])
    rec_after = torch.empty(m, hv, dk, dv)
    prev, core = S, []
    for j in range(m):
        rec_after[j].copy_(prev)
        core.append(eager.recurrent_gated_delta_step(q[j], k[j], v[j], gg[j], beta[j], rec_after[j]))
        prev = rec_after[j]
    return torch.stack(core).reshape(m, vd), rec_after


@pytest.mark.parametrize("m,prefetch,warps", [(1, False, 4), (2, True, 1), (3, False, 1), (4, True, 4)])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 32, 16), (2, 2, 16, 32)])
def test_gdn_verify_step_matches_gdn_verify(m, prefetch, warps, hk, hv, dk, dv):
    buf, S, a_log, dt_bias = _gdn_inputs(m, hk, hv, dk, dv, seed=10 + m)
    o_ref, rec_ref = _gdn_verify_ref(buf, S.clone(), a_log, dt_bias, hk, hv, dk, dv)
    S0 = S.clone()
    rec_after = nan_like(torch.empty(m + 1, hv, dk, dv))  # one row more than m: must stay untouched
    out = nan_like(torch.empty(m, hv * dv + 5, dtype=BF))[:, :hv * dv]  # a row stride past the row
    call(gdn.gdn_verify_step, buf, S, rec_after, out, a_log, dt_bias, m=m, num_k_heads=hk, num_v_heads=hv,
         head_k_dim=dk, head_v_dim=dv, block_v=16, num_warps=warps, prefetch=prefetch)
    assert torch.equal(S, S0)  # the live state is read only
    assert rel(rec_after[:m], rec_ref) < 1e-5 and rec_after[m].isnan().all()
    assert rel(out, o_ref) < 8e-3 and not out.isnan().any()


def test_gdn_verify_step_m1_equals_gdn_step():
    """m = 1: the same token on the same state as the decode kernel, bit for bit."""
    hk, hv, dk, dv = 2, 4, 32, 32
    buf, S, a_log, dt_bias = _gdn_inputs(1, hk, hv, dk, dv, seed=20, pad=0)
    rec_after = nan_like(torch.empty(1, hv, dk, dv))
    out = nan_like(torch.empty(1, hv * dv, dtype=BF))
    kw = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, block_v=16)
    call(gdn.gdn_verify_step, buf, S, rec_after, out, a_log, dt_bias, m=1, **kw)
    out1 = nan_like(torch.empty(hv * dv, dtype=BF))
    call(gdn.gdn_step, buf[0], S, out1, a_log, dt_bias, **kw)
    assert torch.equal(rec_after[0], S) and torch.equal(out[0], out1)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_gdn_commit_selects_position(m):
    g = torch.Generator().manual_seed(30 + m)
    conv_dim, kc, hv, dk, dv, width = 40, 4, 4, 16, 16, 4
    cfg = SimpleNamespace(conv_kernel=kc)
    full = torch.randn(conv_dim, kc - 1 + width, generator=g).to(BF)
    window = full[:, :kc - 1 + m]  # a view with the scratch's row stride, as VerifyScratch.window
    rec_after = torch.randn(width, hv, dk, dv, generator=g)
    for a in sorted({0, m - 1}):
        acc = torch.tensor([a])
        conv, rec = nan_like(torch.empty(conv_dim, kc - 1, dtype=BF)), nan_like(torch.empty(hv, dk, dv))
        conv_ref, rec_ref = conv.clone(), rec.clone()
        eager.gdn_commit(cfg, conv_ref, rec_ref, window, rec_after[:m], acc)
        call(gdn.gdn_commit, conv, rec, window, rec_after[:m], acc, block=256, block_c=16)
        assert torch.equal(conv, conv_ref) and torch.equal(rec, rec_ref), a


@pytest.mark.parametrize("warps", [1, 4])
def test_recommit_equals_the_verify_state_of_the_accepted_token(warps):
    """`Recommit` (Tuning.gdn_recommit): the verify keeps no states; the commit runs tokens 0..a of each layer's
    verify rows again over its live state, every layer in one launch. Byte for byte the state
    `gdn_verify_step` kept for token a and the conv columns `gdn_commit` copies: two layers of one request for
    every a, and two layers of three slots (one not live, one whose round emitted nothing: a = -1; both left
    as they are)."""
    from nexrt_vllm.engine.kernels import batch_round as kbr

    hk, hv, dk, dv, m, conv_dim, kc = 2, 4, 32, 16, 4, 40, 4
    kw = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, block_v=8, num_warps=warps)
    g = torch.Generator().manual_seed(41)
    layers = []
    for layer in range(2):
        bufs, states = [], []
        for b in range(3):
            buf, S, a_log, dt_bias = _gdn_inputs(m, hk, hv, dk, dv, seed=50 + 3 * layer + b, pad=0)
            bufs.append(buf)
            states.append(S)
        buf3, S3 = torch.cat(bufs), torch.stack(states)
        window = torch.randn(3, conv_dim, kc - 1 + m, generator=g).to(BF)
        rec_after = nan_like(torch.empty(3, m, hv, dk, dv))
        out = nan_like(torch.empty(3 * m, hv * dv, dtype=BF))
        all_live = torch.ones(3, dtype=torch.int32)
        call(kbr.gdn_verify_rows, buf3, S3, rec_after, out, a_log, dt_bias, all_live, m=m, **kw)
        out_nostore = nan_like(out)
        call(kbr.gdn_verify_rows, buf3, S3, None, out_nostore, a_log, dt_bias, all_live, m=m, **kw)
        assert torch.equal(out_nostore, out)  # the same outputs without the states
        conv = torch.randn(3, conv_dim, kc - 1, generator=g).to(BF)
        layers.append(dict(buf=buf3, S=S3, window=window, rec_after=rec_after, a_log=a_log, dt_bias=dt_bias,
                           conv=conv))
    dev = lambda t: t.to(DEV)  # noqa: E731 - the table holds device addresses: the tensors live there
    for a in range(m):  # one request (slot 1's rows and state of each layer)
        one = [dict(buf=dev(L["buf"][m:2 * m]), conv=dev(L["conv"][1].clone()), rec=dev(L["S"][1].clone()),
                    window=dev(L["window"][1]), a_log=dev(L["a_log"]), dt_bias=dev(L["dt_bias"])) for L in layers]
        commit = gdn.Recommit([(x["buf"], x["conv"], x["rec"], x["window"], x["a_log"], x["dt_bias"]) for x in one],
                              m=m, block_c=16, **kw)
        commit(torch.tensor([a], device=DEV))
        for L, x in zip(layers, one):
            conv_ref, rec_ref = L["conv"][1].clone(), L["S"][1].clone()
            call(gdn.gdn_commit, conv_ref, rec_ref, L["window"][1], L["rec_after"][1], torch.tensor([a]), block=256,
                 block_c=16)
            assert torch.equal(x["rec"].cpu(), rec_ref) and torch.equal(x["conv"].cpu(), conv_ref), a
    acc, live = torch.tensor([2, 3, -1], device=DEV), torch.tensor([1, 0, 1], dtype=torch.int32, device=DEV)
    slots = [dict(buf=dev(L["buf"]), conv=dev(L["conv"].clone()), rec=dev(L["S"].clone()), window=dev(L["window"]),
                  a_log=dev(L["a_log"]), dt_bias=dev(L["dt_bias"])) for L in layers]
    commit = gdn.Recommit([(x["buf"], x["conv"], x["rec"], x["window"], x["a_log"], x["dt_bias"]) for x in slots],
                          m=m, block_c=16, slots=True, **kw)
    commit(acc, live)
    for L, x in zip(layers, slots):
        rec, conv = x["rec"].cpu(), x["conv"].cpu()
        assert torch.equal(rec[0], L["rec_after"][0, 2]) and torch.equal(conv[0], L["window"][0, :, 3:3 + kc - 1])
        assert torch.equal(rec[1:], L["S"][1:]) and torch.equal(conv[1:], L["conv"][1:])
    with pytest.raises(ValueError, match="`live` goes with slots"):
        commit(acc)
    with pytest.raises(ValueError, match="layer 0's shapes"):
        gdn.Recommit([(x["buf"], x["conv"], x["rec"], x["window"], x["a_log"], x["dt_bias"]) for x in slots[:1]]
                     + [(one[0]["buf"], one[0]["conv"], one[0]["rec"], one[0]["window"], one[0]["a_log"],
                         one[0]["dt_bias"])], m=m, slots=True, **kw)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------

H, KVH, MAXLEN, NSPLIT = 4, 2, 96, 4


def _attn_setup(hd, seed):
    g = torch.Generator().manual_seed(seed)
    hid = 48
    cfg = SimpleNamespace(head_dim=hd, rms_norm_eps=1e-6, rotary_dim=hd // 2, rope_theta=1e7)
    w = eager.AttentionWeights(
        q_proj=(torch.randn(2 * H * hd, hid, generator=g) * 0.2).to(BF),
        k_proj=(torch.randn(KVH * hd, hid, generator=g) * 0.2).to(BF),
        v_proj=(torch.randn(KVH * hd, hid, generator=g) * 0.2).to(BF),
        o_proj=torch.eye(H * hd).to(BF),  # exact: the test compares the gated attention output itself
        q_norm=(0.1 * torch.randn(hd, generator=g)).to(BF), k_norm=(0.1 * torch.randn(hd, generator=g)).to(BF))
    cos, sin = eager.rope_tables(cfg, MAXLEN, BF, "cpu")
    kc = torch.randn(KVH, MAXLEN, hd, generator=g).to(BF)
    vc = torch.randn(KVH, MAXLEN, hd, generator=g).to(BF)
    return g, hid, cfg, w, cos, sin, kc, vc


def _scratch(m, hd):
    return {k: nan_like(torch.empty(n)) for k, n in attention.verify_scratch_sizes(m, H, NSPLIT, MAXLEN, hd).items()}


# (m, pos, start, head_dim): near 0; row 0..2 see no key of the last split (pos 61, m 4: splits of 32
# over [0, 65)); several splits with start > 0; m = 1 with start (the drafter's single-row steps)
CASES = [(1, 0, None, 64), (2, 3, 2, 32), (4, 1, None, 32), (4, 61, None, 64), (2, 70, 5, 32), (3, 33, 20, 64),
         (1, 40, 9, 32), (4, 88, 30, 32)]


@pytest.mark.parametrize("m,pos,start,hd", CASES)
def test_attention_verify_matches_eager_causal(m, pos, start, hd):
    g, hid, cfg, w, cos, sin, kc, vc = _attn_setup(hd, seed=40 + m + pos)
    x = torch.randn(m, hid, generator=g).to(BF)
    positions = pos + torch.arange(m)
    kv_index = torch.arange(MAXLEN)
    visible = kv_index[None, :] <= positions[:, None]  # Model.verify's causal mask ...
    if start is not None:
        visible &= kv_index[None, :] >= start  # ... and the drafter's first valid row
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = eager.attention_decode(w, cfg, x, cos[positions], sin[positions], kc_ref, vc_ref, positions, visible)
    q_ref = eager.attn_qkv(w, cfg, x, cos[positions], sin[positions])[0]  # [H, m, hd]

    # the fused qkv row as the GPU path's projection leaves it, with a row stride past the row
    rows = torch.cat([F.linear(x, w.q_proj), F.linear(x, w.k_proj), F.linear(x, w.v_proj)], -1)
    qkv = torch.zeros(m, rows.shape[1] + 8, dtype=BF)[:, :rows.shape[1]]
    qkv.copy_(rows)
    q = nan_like(torch.empty(m, H * hd, dtype=BF))
    posb = torch.tensor([pos])
    call(attention.qk_rope_cache, qkv, q, kc, vc, w.q_norm, w.k_norm, cos, sin, posb, num_heads=H,
         num_kv_heads=KVH, head_dim=hd, rotary_dim=hd // 2, eps=1e-6, m=m)
    assert rel(q.view(m, H, hd).transpose(0, 1), q_ref) < 8e-3
    new = slice(pos, pos + m)
    assert torch.equal(vc, vc_ref) and rel(kc[:, new], kc_ref[:, new]) < 8e-3
    assert torch.equal(kc[:, :pos], kc_ref[:, :pos]) and torch.equal(kc[:, pos + m:], kc_ref[:, pos + m:])

    out = nan_like(torch.empty(m, H * hd + 4, dtype=BF))[:, :H * hd]
    st = None if start is None else torch.tensor([start])
    call(attention.attention_verify, q, kc, vc, posb, qkv, out, **_scratch(m, hd), m=m, num_heads=H,
         num_kv_heads=KVH, head_dim=hd, start=st, nsplit=NSPLIT, block=16, min_per=16)
    assert not out.isnan().any()
    # against eager attention over the kernel's own q / K / V: equal up to fp32 accumulation order
    tight = eager._attend(q.view(m, H, hd).transpose(0, 1), kc, vc, visible, hd ** -0.5)
    tight = tight * torch.sigmoid(qkv[:, :H * 2 * hd].reshape(m, H, 2, hd)[:, :, 1].reshape(m, -1))
    assert rel(out, tight) < 2e-3
    # end to end against attention_decode under the verify mask (q / k rounding may differ by an ulp)
    assert rel(out, ref) < 1e-2


@pytest.mark.parametrize("min_per", [16, 128])  # 4 live splits; 1 live split
def test_attention_verify_m1_equals_attention_decode(min_per):
    hd, pos = 64, 57
    g, hid, cfg, w, cos, sin, kc, vc = _attn_setup(hd, seed=50)
    qkv = torch.randn(1, H * 2 * hd + 2 * KVH * hd, generator=g).to(BF)
    q = (torch.randn(1, H * hd, generator=g)).to(BF)
    posb = torch.tensor([pos])
    kw = dict(num_heads=H, num_kv_heads=KVH, head_dim=hd, nsplit=NSPLIT, block=16, min_per=min_per)
    sc = _scratch(1, hd)
    out_d = nan_like(torch.empty(H * hd, dtype=BF))
    call(attention.attention_decode, q[0], kc, vc, posb, qkv[0], out_d, sc["m_buf"], sc["l_buf"], sc["acc_buf"],
         sc["s_buf"], **kw)
    for st in (None, torch.tensor([0])):
        out = nan_like(torch.empty(1, H * hd, dtype=BF))
        call(attention.attention_verify, q, kc, vc, posb, qkv, out, **_scratch(1, hd), m=1, start=st, **kw)
        assert torch.equal(out[0], out_d)
