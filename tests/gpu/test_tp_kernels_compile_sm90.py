"""The tensor-parallel step's kernels compile for sm_90, with and without programmatic dependent launch:
the residual add after the all-reduce, the greedy key and its inverse, the one-shot peer collectives
(kernels/tp.py), and the GEMVs' partial-sum epilogue (EPI_PARTIAL, bf16 and FP8 weights), at the 2B shape.
CI has no GPU, so this is what shows the compiled path builds (Triton's bundled ptxas);
test_kernels_compile_sm90.py does the same for the one-GPU step. Runs in a subprocess: the test process
imports the kernels interpreted.
"""
import pytest

SCRIPT = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nexrt_vllm.engine.kernels import gemv, tp

G = dict(GROUP=1, KC=4, KCP=4, STORE_XN=False, KP=2048, BLOCK_N=16, BLOCK_K=256, EVEN_K=True, VEC=8, PF=0, PRE=0)
GF = dict({k: v for k, v in G.items() if k not in ("PF", "PRE")}, BLOCK_N=2, BLOCK_K=2048, BKS=128, UNIFORM=True,
          ROUND_W=False, TAIL=False, VEC=16, VEC_T=8)
PARTIAL = {"y_ptr": "*fp32", "aux0_ptr": "*bf16", "aux1_ptr": "*bf16", "pf_ptr": "*u8"}
FP8 = dict(PARTIAL, w_ptr="*fp8e4nv", s_ptr="*fp32", srow_ptr="*i32")
KEY = {"pmax_ptr": "*fp32", "pidx_ptr": "*i32", "logits_ptr": "*fp32", "key_ptr": "*i64", "res_ptr": "*bf16",
       "part_ptr": "*fp32"}
VARIANTS = [
    ("o_proj_partial", gemv.gemv_kernel, dict(G, PRO=0, EPI=5), 4, PARTIAL),
    ("gdn_out_proj_partial", gemv.gemv_kernel, dict(G, PRO=2, EPI=5, GROUP=128, BLOCK_N=8, BLOCK_K=1024, PRE=2), 8,
     PARTIAL),
    ("fp8_down_partial", gemv.gemv_fp8_kernel, dict(GF, PRO=0, EPI=5), 4, FP8),
    ("residual_add", tp.residual_add_kernel, dict(BLOCK=1024), 4, KEY),
    ("argmax_key", tp.argmax_key_kernel, dict(BLOCK=16384), 8, KEY),
    ("key_argmax", tp.key_argmax_kernel, {}, 1, KEY),
]
PEER = {"bufs_ptr": "*i64", "sigs_ptr": "*i64", "epoch_ptr": "*i32", "status_ptr": "*i32"}
for op, dt, out in ((tp.OP_SUM, "fp32", "fp32"), (tp.OP_MAX, "i64", "i64"), (tp.OP_GATHER, "fp32", "fp32"),
                    (tp.OP_BCAST, "i64", "i64"), (tp.OP_SUM_RESIDUAL, "fp32", "bf16")):
    VARIANTS.append((f"peer_op{op}", tp.peer_collective_kernel,
                     dict(SIZE=2, OP=op, BLOCK=tp.PEER_BLOCK, SPIN=1 << 22, ASM=True), 4,
                     dict(PEER, x_ptr="*" + dt, out_ptr="*" + out)))
out = {}
for pdl in (False, True):
    for name, fn, consts, nw, types in VARIANTS:
        consts = dict(consts, PDL=pdl)
        names = list(fn.arg_names)
        sig = {n: types.get(n, "constexpr" if n in consts else "*bf16" if n.endswith("_ptr") else
                  "fp32" if n == "eps" else "i32") for n in names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})
        ptx = k.asm["ptx"]
        out[name + ("_pdl" if pdl else "")] = {"cubin_bytes": len(k.asm["cubin"]),
                                                "griddep": ptx.count("griddepcontrol"),
                                                "release_sys": ptx.count("atom.global.sys.release"),
                                                "fence_sys": ptx.count("fence.sc.sys"),
                                                "volatile": ptx.count("ld.volatile")}
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def compiled(compile_sm90):
    return compile_sm90(SCRIPT)


def test_tp_kernels_build_cubins_with_the_pdl_pair_only_with_pdl(compiled):
    assert len(compiled) == 22
    for name, v in compiled.items():
        assert v["cubin_bytes"] > 0, name
        assert (v["griddep"] >= 2) if name.endswith("_pdl") else v["griddep"] == 0, (name, v)


def test_peer_collectives_flag_with_system_scope_release_and_spin_on_volatile_reads(compiled):
    """The one-shot collectives' ordering, as compiled: each peer's flag written by a system-scope release
    atomic (after the CTA barrier that follows the input's store), the flags read volatile, and a
    system-scope fence between the flags and the peers' inputs."""
    peer = {n: v for n, v in compiled.items() if n.startswith("peer_op")}
    assert len(peer) == 10
    for name, v in peer.items():
        assert v["release_sys"] == 2 and v["fence_sys"] >= 1 and v["volatile"] >= 2, (name, v)
