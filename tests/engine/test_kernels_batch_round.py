"""The batched round's GDN in_proj + conv (kernels/batch_round.py `gemv_conv_slots`): B slots x M positions,
the conv epilogue slot by slot or over every slot's rows at once (`Tuning.conv_all_slots`).

Both forms give the same rows and windows (byte for byte in the interpreter; on a device within the fp32
summation order of a reduction's layout), leave the live conv states and a dead slot's window untouched,
and each live slot's rows equal the one-request round's kernel (`gemv(..., m=M)`, EPI_CONV) on its rows
alone. The batched round end to end: tests/gpu/test_fused_batch_round.py.
"""
import pytest
import torch

from nexrt_vllm.engine import kernels
from nexrt_vllm.testing.kernel_calls import DEV, call, rel

kernels.load(interpret=DEV == "cpu")
from nexrt_vllm.engine.kernels import batch_round, gemv  # noqa: E402 - after load() picked the mode

torch.set_num_threads(1)
BF = torch.bfloat16
SAME = 2e-3  # fp32 summation order only (tests/engine/test_kernels_verify_gemv.py)


@pytest.mark.parametrize("slots,m", [(3, 4), (4, 3)])
def test_conv_all_slots_equals_slot_by_slot(slots, m):
    g = torch.Generator().manual_seed(41)
    conv_n, extra, kc, k = 48, 20, 4, 64
    r = slots * m
    x = torch.randn(r, k, generator=g).to(BF)
    nw = (torch.randn(k, generator=g) * 0.1).to(BF)
    w = (torch.randn(conv_n + extra, k, generator=g) * 0.2).to(BF)
    cw = (torch.randn(conv_n, kc, generator=g) * 0.5).to(BF)
    conv = torch.randn(slots, conv_n, kc - 1, generator=g).to(BF)
    conv0 = conv.clone()
    live = torch.ones(slots, dtype=torch.int32)
    live[1] = 0  # a dead slot between live ones
    out = {}
    for all_slots in (False, True):
        y = torch.full((r, conv_n + extra), float("nan"), dtype=BF)
        window = torch.full((slots, conv_n, kc - 1 + m + 2), float("nan"), dtype=BF)  # wider, as the scratch
        call(batch_round.gemv_conv_slots, x, w, y, nw, conv, cw, window, live, m=m, eps=1e-6, conv_n=conv_n, kc=kc,
             block_n=16, block_k=32, num_warps=2, all_slots=all_slots)
        assert torch.equal(conv, conv0)  # the live states: read only
        assert window[1].isnan().all() and window[:, :, kc - 1 + m:].isnan().all()
        out[all_slots] = y, window[:, :, :kc - 1 + m]
    (y0, w0), (y1, w1) = out[False], out[True]
    assert not y1.isnan().any()
    assert rel(y1, y0) < SAME and rel(w1[live.bool()], w0[live.bool()]) < SAME
    if DEV == "cpu":
        assert torch.equal(y1, y0) and torch.equal(w1[live.bool()], w0[live.bool()])
    for b in (0, 2):  # a live slot's rows: the one-request round's kernel on them alone
        rows = slice(b * m, (b + 1) * m)
        ya = torch.full((m, conv_n + extra), float("nan"), dtype=BF)
        wa = torch.full((conv_n, kc - 1 + m), float("nan"), dtype=BF)
        call(gemv.gemv, x[rows], w, ya, pro=gemv.PRO_RMSNORM, epi=gemv.EPI_CONV, norm_w=nw, aux0=conv[b].clone(),
             aux1=cw, conv_n=conv_n, kc=kc, block_n=16, block_k=32, m=m, window=wa, dot=2)
        assert rel(y1[rows], ya) < SAME, b
        assert rel(w1[b], wa) < SAME, b
    with pytest.raises(ValueError, match="slots x"):  # rows that are not slots x m
        batch_round.gemv_conv_slots(x[:r - 1], w, y1[:r - 1], nw, conv, cw, w1, live, m=m, eps=1e-6, conv_n=conv_n,
                                    kc=kc, block_n=16, block_k=32, num_warps=2)
