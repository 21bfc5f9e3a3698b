"""The speculative verify's GDN step without per-position states, and the commit that recomputes the
accepted positions (`Tuning.gdn_verify_recompute`), against the path that keeps a state per position:
the verify's outputs bit for bit, and for every accepted count the committed recurrent and conv states
bit for bit (the same programs run the same arithmetic), within the eager oracle's tolerance of
`gdn_verify` / `gdn_commit`. Interpreter on CPU, compiled with NEXRT_KERNEL_DEVICE=cuda; outputs
poisoned with NaN before each launch.
"""
from types import SimpleNamespace

import pytest
import torch

from nexrt_vllm.engine import kernels
from nexrt_vllm.engine import model as eager
from nexrt_vllm.testing.kernel_calls import DEV, call, rel
from test_kernels_verify_attn_gdn import _gdn_inputs, _gdn_verify_ref, nan_like

gdn = dict(zip(kernels.MODULES, kernels.load(interpret=DEV == "cpu")))["gdn"]

torch.set_num_threads(1)
BF = torch.bfloat16
KC, WIDTH = 4, 4  # conv kernel; the scratch's verify width


def _window(conv_dim, m, seed):
    """The conv window as the verify's EPI_CONV leaves it: a view of the scratch's [conv_dim, KC-1+WIDTH]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(conv_dim, KC - 1 + WIDTH, generator=g).to(BF)[:, :KC - 1 + m]


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("hk,hv,dk,dv,block_v,warps,prefetch", [
    (2, 4, 32, 16, 16, 1, True), (2, 2, 16, 32, 16, 4, False), (1, 2, 32, 32, 32, 1, False)])
def test_recomputing_commit_equals_the_copy(m, hk, hv, dk, dv, block_v, warps, prefetch):
    buf, S, a_log, dt_bias = _gdn_inputs(m, hk, hv, dk, dv, seed=60 + m + dv)
    conv_dim = 2 * hk * dk + hv * dv
    window = _window(conv_dim, m, seed=70 + m)
    shape = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, block_v=block_v, num_warps=warps,
                 prefetch=prefetch)
    o_ref, rec_ref = _gdn_verify_ref(buf, S.clone(), a_log, dt_bias, hk, hv, dk, dv)
    # the path that keeps a state per position
    rec_after = nan_like(torch.empty(m, hv, dk, dv))
    out_keep = nan_like(torch.empty(m, hv * dv, dtype=BF))
    call(gdn.gdn_verify_step, buf, S, rec_after, out_keep, a_log, dt_bias, m=m, **shape)
    # the verify without: the same outputs, the live state untouched
    S0 = S.clone()
    out = nan_like(torch.empty(m, hv * dv + 5, dtype=BF))[:, :hv * dv]  # a row stride past the row
    call(gdn.gdn_verify_step, buf, S, None, out, a_log, dt_bias, m=m, **shape)
    assert torch.equal(out, out_keep) and torch.equal(S, S0)
    assert rel(out, o_ref) < 8e-3
    for a in range(m):
        acc = torch.tensor([a])
        conv_copy, rec_copy = nan_like(torch.empty(conv_dim, KC - 1, dtype=BF)), nan_like(torch.empty(hv, dk, dv))
        call(gdn.gdn_commit, conv_copy, rec_copy, window, rec_after, acc, block=256, block_c=16)
        conv, rec = nan_like(torch.empty(conv_dim, KC - 1, dtype=BF)), S.clone()
        call(gdn.gdn_commit_recompute, conv, rec, window, buf, acc, a_log, dt_bias, block_c=32, **shape)
        assert torch.equal(rec, rec_copy) and torch.equal(conv, conv_copy), a
        # and against the eager oracle's commit
        conv_e, rec_e = conv.clone().fill_(float("nan")), rec.clone().fill_(float("nan"))
        eager.gdn_commit(SimpleNamespace(conv_kernel=KC), conv_e, rec_e, window, rec_ref, acc)
        assert torch.equal(conv, conv_e) and rel(rec, rec_e) < 1e-5, a


def test_recomputing_commit_reads_only_the_accepted_rows():
    """Rows past the accepted one (tokens the round rejected) may hold anything."""
    hk, hv, dk, dv, m, a = 2, 4, 32, 16, 4, 1
    buf, S, a_log, dt_bias = _gdn_inputs(m, hk, hv, dk, dv, seed=80)
    window = _window(2 * hk * dk + hv * dv, m, seed=81)
    shape = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, block_v=16, num_warps=1)
    rec, conv = S.clone(), nan_like(torch.empty(window.shape[0], KC - 1, dtype=BF))
    call(gdn.gdn_commit_recompute, conv, rec, window, buf, torch.tensor([a]), a_log, dt_bias, **shape)
    junk = buf.clone()
    junk[a + 1:] = float("nan")
    rec2, conv2 = S.clone(), nan_like(conv)
    call(gdn.gdn_commit_recompute, conv2, rec2, window, junk, torch.tensor([a]), a_log, dt_bias, **shape)
    assert torch.equal(rec2, rec) and torch.equal(conv2, conv) and not rec.isnan().any()
