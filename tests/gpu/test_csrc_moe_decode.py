"""The persistent CUDA MoE kernel (csrc/moe_decode.cu, nexrt_vllm/engine/cuda_kernels.py).

On CPU (CI): the layout plan for the real shapes and its refusals, and the kernel built for sm_90a
with this machine's nvcc (no spills, no stack frame). With NEXRT_KERNEL_DEVICE=cuda
(benchmarks/gpu_check.py on the H200): the kernel against the eager MoE block on random inputs of
several shapes (poisoned outputs), repeated launches and graph replays bit-identical.
"""
import os
import re
from types import SimpleNamespace

import pytest
import torch

from nexrt_vllm.engine import cuda_kernels as ck
from nexrt_vllm.engine import model as M

DEV = os.environ.get("NEXRT_KERNEL_DEVICE", "cpu")
H200 = dict(num_sms=132, smem_optin=232448)
torch.set_num_threads(1)


def test_plan_fits_35b_a3b_and_refuses_what_does_not_fit():
    p = ck.moe_decode_plan(2048, 256, 8, 512, 512, **H200)  # Qwen3.5-35B-A3B
    assert (p.grid, p.rows_per_cta, p.stages, p.tiles) == (132, 16, 12, 1 + 9 * 2 + 9)
    assert p.smem <= H200["smem_optin"] - ck.STATIC_SMEM
    assert ck.moe_decode_plan(2048, 512, 10, 512, 512, **H200).stages >= 12  # Qwen3-Next-80B-A3B
    with pytest.raises(ck.CudaKernelUnsupported, match="down tiles"):  # 397B-A17B-like: H 4096, I 1024
        ck.moe_decode_plan(4096, 512, 10, 1024, 1024, **H200)
    with pytest.raises(ck.CudaKernelUnsupported, match="pair must fit"):
        ck.moe_decode_plan(8192, 512, 10, 1024, 1024, **H200)
    with pytest.raises(ck.CudaKernelUnsupported, match="% 64"):
        ck.moe_decode_plan(2048, 256, 8, 520, 512, **H200)
    with pytest.raises(ck.CudaKernelUnsupported, match="% 64"):
        ck.moe_decode_plan(2080, 256, 8, 512, 512, **H200)
    with pytest.raises(ck.CudaKernelUnsupported, match="top_k"):
        ck.moe_decode_plan(2048, 256, 17, 512, 512, **H200)
    with pytest.raises(ck.CudaKernelUnsupported, match="shared memory"):
        ck.moe_decode_plan(2048, 256, 8, 512, 512, num_sms=132, smem_optin=48 * 1024)


@pytest.mark.skipif(ck.nvcc_path() is None, reason="no nvcc on this machine: the sm_90a build is not checked here")
def test_builds_for_sm90a_without_spills(tmp_path, monkeypatch):
    monkeypatch.setenv("NEXRT_CACHE_DIR", str(tmp_path))
    cubin, log = ck.compile_cubin("moe_decode")
    assert cubin[:4] == b"\x7fELF"
    assert "moe_decode_kernel" in log and "sm_90a" in log, log
    assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", log), log
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    assert regs <= 255, log
    assert ck.compile_cubin("moe_decode")[0] == cubin  # second call: from the cache
    assert len(list(tmp_path.glob("cubin/moe_decode-*.cubin"))) == 1


def _weights(H, E, K, I, Is, g, dev):
    s = H ** -0.5
    bf = torch.bfloat16
    r = lambda *shape, sc=s: (torch.randn(*shape, generator=g) * sc).to(bf).to(dev)  # noqa: E731
    return dict(res=r(H, sc=1.0), ln=r(H, sc=0.1), wr=r(E + 1, H, sc=3 * s), gu=r(E, 2 * I, H), dn=r(E, H, I, sc=I ** -0.5),
                sgu=r(2 * Is, H), sdn=r(H, Is, sc=Is ** -0.5))


def _eager(w, K, eps):
    """The eager engine's post-attention block: res + MoE(rms_norm(res)), its router logits and routing."""
    E = w["gu"].shape[0]
    Is = w["sdn"].shape[1]
    moe_w = M.MoEWeights(router=w["wr"][:E], gate_up_proj=w["gu"], down_proj=w["dn"],
                         shared=M.MLPWeights(w["sgu"][:Is], w["sgu"][Is:], w["sdn"]), shared_gate=w["wr"][E:])
    cfg = SimpleNamespace(num_experts_per_tok=K, norm_topk_prob=True)
    xn = M.rms_norm(w["res"][None], w["ln"], eps)
    logits = torch.nn.functional.linear(xn, w["wr"])[0]
    top_w, top_i = M._route(moe_w, cfg, xn)
    order = torch.argsort(top_i[0])
    return w["res"] + M.moe_decode(moe_w, cfg, xn)[0], logits, top_i[0][order], top_w[0][order]


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.skipif(DEV != "cuda", reason="runs the compiled kernel: GPU only (benchmarks/gpu_check.py)")
@pytest.mark.parametrize("H,E,K,I,Is", [(2048, 256, 8, 512, 512), (2048, 512, 10, 512, 512), (64, 16, 4, 32, 48),
                                        (256, 60, 6, 112, 144)])
def test_matches_eager_moe_block(H, E, K, I, Is):
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(H + E + K)
    w = _weights(H, E, K, I, Is, g, dev)
    eps = 1e-6
    ref_res, ref_logits, ref_ids, ref_wts = _eager(w, K, eps)
    kern = ck.MoeDecode(dev, H, E, K, I, Is)
    res0 = w["res"].clone()
    bf = torch.bfloat16
    out = dict(logits=torch.full((E + 1,), float("nan"), dtype=bf, device=dev),
               act=torch.full(((K + 1) * max(I, Is),), float("nan"), dtype=bf, device=dev),
               ids=torch.full((K,), -1, dtype=torch.int32, device=dev),
               wts=torch.full((K,), float("nan"), dtype=torch.float32, device=dev))

    def launch(res):
        kern.launch(res, w["ln"], w["wr"], w["gu"], w["dn"], w["sgu"], w["sdn"], out["logits"], out["act"], out["ids"],
                    out["wts"], eps=eps, norm_topk=True)

    res = res0.clone()
    launch(res)
    torch.cuda.synchronize()
    assert not torch.isnan(out["logits"]).any() and not torch.isnan(res.float()).any()
    assert _rel(out["logits"], ref_logits) < 1e-2
    assert out["ids"].tolist() == ref_ids.tolist()
    assert torch.allclose(out["wts"], ref_wts.float(), rtol=1e-2, atol=0)
    contrib, ref_contrib = res.float() - res0.float(), ref_res.float() - res0.float()
    assert _rel(contrib, ref_contrib) < 2e-2, _rel(contrib, ref_contrib)
    # every hidden row written exactly once with the MoE's contribution (a skipped row would equal res0)
    assert (contrib != 0).float().mean() > 0.95
    first = res.clone()
    for _ in range(3):  # repeated launches: the monotonic barrier counters need no reset
        res.copy_(res0)
        launch(res)
    torch.cuda.synchronize()
    assert torch.equal(res, first)
    graph_res = res0.clone()
    launch(graph_res)  # warm-up outside capture
    gr = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(gr, stream=s):
            launch(graph_res)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        graph_res.copy_(res0)
        gr.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_res, first)
