"""The decode kernels compile for sm_90 with programmatic dependent launch and L2 prefetch on.

CI has no GPU, so the interpreter tests (test_kernels_decode_ops.py) never see the code that only
exists when PDL is on: the `gdc_wait` / `gdc_launch_dependents` pair and the inline-PTX prefetch
before the wait (kernels/common.py). This compiles those variants to PTX and cubin with Triton's
bundled ptxas for an H100/H200 target and checks that the prefetches and the grid-dependency
instructions are really in the code (an optimised-away prefetch would pass every numeric test).
Runs in a subprocess: the test process imports the kernels in interpreter mode.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nexrt_vllm.engine.kernels import attention, gdn, gemv, moe, route, sampling

FP32_PTRS = {"state_ptr", "wts_ptr", "m_ptr", "l_ptr", "acc_ptr", "s_ptr", "pmax_ptr", "cum_ptr", "params_ptr",
             "vals_ptr", "cos_ptr", "sin_ptr"}
I32_PTRS = {"ids_ptr", "pidx_ptr", "idx_ptr"}
I64_PTRS = {"tok_ptr", "pos_ptr", "step_ptr", "ring_ptr", "seed_ptr"}
FP32_SCALARS = {"eps", "q_scale", "scale"}


def compile_(fn, consts, num_warps=4):
    names = list(fn.arg_names)
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = "*fp32" if n in FP32_PTRS else "*i32" if n in I32_PTRS else "*i64" if n in I64_PTRS else "*bf16"
        else:
            sig[n] = "fp32" if n in FP32_SCALARS else "i32"
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in consts]
    assert not missing, f"{fn.__name__}: constexprs not given: {missing}"
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    ptx = k.asm["ptx"]
    return {"prefetch": ptx.count("prefetch.global.L2"), "griddep": ptx.count("griddepcontrol"),
            "cubin_bytes": len(k.asm["cubin"])}


on = dict(PDL=True, PREFETCH=True)
G = dict(GROUP=1, KC=4, KCP=4, STORE_XN=False, BLOCK_N=16, BLOCK_K=256, EVEN_K=True, LINES=32)
out = {
    "gemv_rmsnorm_swiglu": compile_(gemv.gemv_kernel, dict(G, PRO=1, EPI=2, **on)),
    "gemv_rmsnorm_conv": compile_(gemv.gemv_kernel, dict(G, PRO=1, EPI=3, **on)),
    "gemv_gated_residual": compile_(gemv.gemv_kernel, dict(G, PRO=2, EPI=1, GROUP=128, BLOCK_N=8, BLOCK_K=1024,
                                                           **on), num_warps=8),
    "gemv_lm_head_argmax": compile_(gemv.gemv_kernel, dict(G, PRO=1, EPI=4, BLOCK_N=32, **on)),
    "gemv_router_xn": compile_(gemv.gemv_kernel, dict(G, PRO=1, EPI=0, STORE_XN=True, BLOCK_N=4, BLOCK_K=1024,
                                                      **on), num_warps=8),
    "gemv_pdl_no_prefetch": compile_(gemv.gemv_kernel, dict(G, PRO=1, EPI=0, PDL=True, PREFETCH=False)),
    "moe_gate_up": compile_(moe.moe_gate_up_kernel, dict(TOPK=8, IMAX=512, BLOCK_N=16, BLOCK_K=256, ROUTE=True, E=256,
                                                         EP=256, NORM=True, LINES=32, **on)),
    "moe_down": compile_(moe.moe_down_kernel, dict(E=256, EP=256, NORM=True, TOPK=8, IMAX=512, BLOCK_N=2, BLOCK_K=512,
                                                   LINES=8, LINES_S=8, **on)),
    "attn_scores": compile_(attention.attn_scores_kernel, dict(NSPLIT=256, MIN_PER=32, G=8, GP=16, HD=256, BLOCK=32,
                                                              DOT_F32=False, LINES=4, **on)),
    "attn_pv": compile_(attention.attn_pv_kernel, dict(NSPLIT=256, MIN_PER=32, G=8, GP=16, HD=256, BLOCK=32,
                                                      DOT_F32=False, LINES=4, **on)),
    "gdn_step": compile_(gdn.gdn_step_kernel, dict(HV=32, HK=16, DK=128, DV=128, BLOCK_V=16, LINES=1, **on)),
}
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_every_variant_builds_a_cubin(compiled):
    assert all(v["cubin_bytes"] > 0 for v in compiled.values()), compiled


@pytest.mark.parametrize("name", ["gemv_rmsnorm_swiglu", "gemv_rmsnorm_conv", "gemv_gated_residual",
                                  "gemv_lm_head_argmax", "gemv_router_xn", "moe_gate_up", "moe_down", "gdn_step",
                                  "attn_scores", "attn_pv"])
def test_prefetch_and_grid_dependency_are_emitted(compiled, name):
    assert compiled[name]["prefetch"] > 0, compiled[name]
    assert compiled[name]["griddep"] >= 2, compiled[name]  # wait + launch_dependents


def test_prefetch_off_emits_none(compiled):
    assert compiled["gemv_pdl_no_prefetch"]["prefetch"] == 0
    assert compiled["gemv_pdl_no_prefetch"]["griddep"] >= 2
