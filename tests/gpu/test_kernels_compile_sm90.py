"""The decode kernels compile for sm_90, with and without programmatic dependent launch.

CI has no GPU, so the interpreter tests (tests/engine/test_kernels_decode_ops.py) never see the compiled code
paths: the Triton frontend + PTX backend + ptxas for an H100/H200 target, and the code that only
exists with PDL on (the `gdc_wait` / `gdc_launch_dependents` pair, kernels/common.py). This builds
the kernel variants the two real shapes use with Triton's bundled ptxas and checks the cubin and
the grid-dependency instructions. Runs in a subprocess: the test process imports the kernels in
interpreter mode.
"""
import pytest

SCRIPT = r'''
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nexrt_vllm.engine.kernels import attention, batch, batch_round, gdn, gemv, moe, sampling, spec

FP32_PTRS = {"part_ptr", "state_ptr", "wts_ptr", "m_ptr", "l_ptr", "acc_ptr", "s_ptr", "pmax_ptr", "cum_ptr", "params_ptr",
             "vals_ptr", "cos_ptr", "sin_ptr"}
I32_PTRS = {"ids_ptr", "pidx_ptr", "idx_ptr", "cnt_ptr"}
I64_PTRS = {"tok_ptr", "pos_ptr", "step_ptr", "ring_ptr", "seed_ptr"}
FP32_SCALARS = {"eps", "q_scale", "scale"}


# the logprob / grammar-mask kernels (kernels/sampling.py); their logits are the fp32 lm_head output
LP_TYPES = {"logits_ptr": "*fp32", "tmax_ptr": "*fp32", "tsum_ptr": "*fp32", "topv_ptr": "*fp32", "lpv_ptr": "*fp32",
            "tidx_ptr": "*i32", "topi_ptr": "*i32", "k_ptr": "*i32", "mask_ptr": "*i32", "lpi_ptr": "*i32",
            "flag_ptr": "*i64", "status_ptr": "*i64", "pf_ptr": "*u8"}


def compile_(fn, consts, num_warps=4, types=None, aligned=(), **options):
    names = list(fn.arg_names)
    sig = {}
    for n in names:
        if types and n in types:
            sig[n] = types[n]
        elif n in consts:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = "*fp32" if n in FP32_PTRS else "*i32" if n in I32_PTRS else "*i64" if n in I64_PTRS else "*bf16"
        else:
            sig[n] = "fp32" if n in FP32_SCALARS else "i32"
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in consts]
    assert not missing, f"{fn.__name__}: constexprs not given: {missing}"
    # `aligned`: arguments the launcher specializes as multiples of 16 (pointers, strides), as the
    # runtime does for the real shapes: what lets loads vectorize.
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})
    ptx = k.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    return {"griddep": ptx.count("griddepcontrol"),
            "loads_before_wait": ptx[:wait].count("ld.global") if wait >= 0 else None, "cubin_bytes": len(k.asm["cubin"]),
            "fence_sys": ptx.count("fence.sc.sys"), "volatile_loads": ptx.count("ld.volatile"),
            "e4m3_cvt": ptx.count("cvt.rn.f16x2.e4m3x2"),
            "evict_first_v4": ptx.count("ld.global.L1::evict_first.L2::cache_hint.v4.b32"),
            "cp_async": ptx.count("cp.async.cg.shared.global"), "wgmma": ptx.count("wgmma.mma_async"),
            "mma": ptx.count("mma.sync.aligned"), "l2_prefetch": ptx.count("cp.async.bulk.prefetch.L2.global"),
            "l2_before_wait": ptx[:wait].count("cp.async.bulk.prefetch.L2.global") if wait >= 0 else None,
            "atomics": ptx.count("atom.global.gpu.acq_rel")}


G = dict(GROUP=1, KC=4, KCP=4, STORE_XN=False, KP=2048, BLOCK_N=16, BLOCK_K=256, EVEN_K=True, VEC=8, PF=0)
A = dict(NSPLIT=256, MIN_PER=32, G=8, GP=16, HD=256, BLOCK=32, DOT_F32=False)
FIN = dict(BLOCK=1024, LP=False, CHECK=False, KMAX=sampling.KMAX, TB=128, CB=4096, ASM=True)
TAIL = dict(CHUNK=2048, KMAX=sampling.KMAX, MASK=False, TOPK=False, WRITE=False, SPIN=1 << 21, ASM=True)
# FP8 (fp8.FP8Weight): e4m3 weights, fp32 scales, int32 scale-row map; routed / shared expert weights.
F8 = {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "srow_ptr": "*i32", "aux0_ptr": "*bf16", "aux1_ptr": "*bf16",
      "gu_ptr": "*fp8e4nv", "gus_ptr": "*fp32", "gur_ptr": "*i32", "sgu_ptr": "*fp8e4nv", "sgus_ptr": "*fp32",
      "sgur_ptr": "*i32", "dn_ptr": "*fp8e4nv", "dns_ptr": "*fp32", "dnr_ptr": "*i32", "sdn_ptr": "*fp8e4nv",
      "sdns_ptr": "*fp32", "sdnr_ptr": "*i32"}
F8_ARGMAX = dict(F8, aux0_ptr="*fp32", aux1_ptr="*i32")
GF = dict({k: v for k, v in G.items() if k != "PF"}, BLOCK_N=2, BLOCK_K=2048, BKS=128, UNIFORM=True, ROUND_W=False,
          TAIL=False, VEC=16, VEC_T=8)
MF = dict(K=2048, I=512, IS=512, TOPK=8, IMAX=512, BLOCK_N=8, BLOCK_K=512, E=256, EP=256, NORM=True, BKS=128,
          FP8_E=True, FP8_S=True, UNI_E=True, UNI_S=True, ROUND_W=False, VEC_E=16, VEC_S=16, M=1, HAS_LIVE=False)
MDF = dict(I=512, IS=512, E=256, TOPK=8, TOPKP=8, IMAX=512, BLOCK_N=2, BLOCK_K=256, BKS=128, FP8_E=True,
           FP8_S=True, UNI_E=True, UNI_S=True, ROUND_W=False, VEC_E=16, VEC_S=16, M=1, EVEN=True, HAS_LIVE=False)
ALIGN_G = ("x_ptr", "w_ptr", "s_ptr", "srow_ptr", "t_ptr", "y_ptr", "nw_ptr", "z_ptr", "K", "stride_w", "stride_t")
ALIGN_M = ("x_ptr", "gu_ptr", "sgu_ptr", "act_ptr", "stride_ge", "act_ptr", "dn_ptr", "sdn_ptr", "stride_de")
FP8_VARIANTS = [
    # the 2B / 35B-A3B step's FP8 launches at the Tuning fp8 defaults
    ("fp8_qkv", gemv.gemv_fp8_kernel, dict(GF, PRO=1, EPI=0), 4, F8, ALIGN_G),
    ("fp8_in_proj_conv_tail", gemv.gemv_fp8_kernel, dict(GF, PRO=1, EPI=3, BLOCK_N=16, BLOCK_K=512, TAIL=True), 4, F8,
     ALIGN_G),
    ("fp8_gated_residual", gemv.gemv_fp8_kernel, dict(GF, PRO=2, EPI=1, GROUP=128, BLOCK_N=8), 8, F8, ALIGN_G),
    ("fp8_swiglu", gemv.gemv_fp8_kernel, dict(GF, PRO=1, EPI=2, BLOCK_N=8, BLOCK_K=512), 4, F8, ALIGN_G),
    ("fp8_residual", gemv.gemv_fp8_kernel, dict(GF, PRO=0, EPI=1), 4, F8, ALIGN_G),
    ("fp8_lm_head_argmax", gemv.gemv_fp8_kernel, dict(GF, PRO=1, EPI=4, BLOCK_N=32, BLOCK_K=512), 4, F8_ARGMAX, ALIGN_G),
    ("fp8_router_xn", gemv.gemv_fp8_kernel, dict(GF, PRO=1, EPI=0, STORE_XN=True, BLOCK_N=4), 8, F8, ALIGN_G),
    ("fp8_rows_per_row_scales", gemv.gemv_fp8_kernel, dict(GF, PRO=1, EPI=2, BLOCK_N=16, BLOCK_K=512, UNIFORM=False),
     4, F8, ALIGN_G),
    ("fp8_round_weights", gemv.gemv_fp8_kernel, dict(GF, PRO=1, EPI=0, ROUND_W=True), 4, F8, ALIGN_G),
    ("fp8_moe_gate_up", moe.moe_gate_up_fp8_kernel, MF, 2, F8, ALIGN_M),
    ("fp8_moe_gate_up_bf16_shared", moe.moe_gate_up_fp8_kernel, dict(MF, FP8_S=False, VEC_S=8), 1,
     dict(F8, sgu_ptr="*bf16"), ALIGN_M),
    ("fp8_moe_down", moe.moe_down_fp8_kernel, MDF, 1, F8, ALIGN_M),

    ("fp8_moe_down_round", moe.moe_down_fp8_kernel, dict(MDF, ROUND_W=True, UNI_E=False, BLOCK_N=2), 1, F8, ALIGN_M),
]
# The speculative round (engine/gpu/spec_round.py) at M = 4 verify rows, the 2B / 35B-A3B shapes at the Tuning defaults.
R = dict(GROUP=1, KC=4, KCP=4, STORE_XN=False, KP=2048, BLOCK_N=16, BLOCK_K=256, EVEN_K=True, VEC=8, M=4, MP=4,
         FP8=False, BKS=1, UNIFORM=True, ROUND_W=False, TAIL=False, PF=0)
ALIGN_R = ("x_ptr", "w_ptr", "y_ptr", "nw_ptr", "z_ptr", "win_ptr", "K", "stride_w", "stride_x", "stride_y", "stride_z")
RD = dict(GROUP=1, KC=4, KCP=4, STORE_XN=False, KP=2048, BLOCK_N=16, BLOCK_K=256, EVEN_K=True, M=4, MP=4, DOT=1,
          SPLITS=1, FP8=False, BKS=1, UNIFORM=True, ROUND_W=False, TAIL=False, PF=0)
# the M-row GEMVs over FP8 weights (the verify / batch step of an FP8 checkpoint): K blocks of whole scale blocks
RDF = dict(RD, FP8=True, BKS=128, BLOCK_K=128, ROUND_W=False)
RF = dict(R, FP8=True, BKS=128, BLOCK_K=512, VEC=8)
ARGMAX = {"y_ptr": "*fp32", "aux0_ptr": "*fp32", "aux1_ptr": "*i32"}
SPEC_T = {"forced_ptr": "*i64", "rec_ptr": "*fp32", "rec_after_ptr": "*fp32", "start_ptr": "*i64", "a_ptr": "*i64", "y_ptr": "*i64",
          "base_ptr": "*i64", "nacc_ptr": "*i64", "round_ptr": "*i64", "rounds_ptr": "*i64", "dtok_ptr": "*i64",
          "dpos_ptr": "*i64", "live_ptr": "*i32", "max_len": "i64"}
# the MoE experts at the step's one-warp defaults (M = 1 token row; the verify: M = 4)
MU = dict(K=2048, I=512, IS=512, TOPK=8, IMAX=512, BLOCK_N=2, BLOCK_K=256, E=256, EP=256, NORM=True, VEC=8, M=1,
          HAS_LIVE=False)
MD = dict(I=512, IS=512, E=256, TOPK=8, TOPKP=8, IMAX=512, BLOCK_N=1, BLOCK_K=512, VEC=8, M=1, HAS_LIVE=False)
AV = dict(M=4, HAS_START=False, NSPLIT=128, MIN_PER=64, H=8, G=4, RP=16, HD=256, BLOCK=64, DOT_F32=False)
SPEC_VARIANTS = [
    ("rows_rmsnorm_store", gemv.gemv_rows_kernel, dict(R, PRO=1, EPI=0, PRE=0), 4, {}, ALIGN_R),
    ("rows_qkv_prefetch", gemv.gemv_rows_kernel, dict(R, PRO=1, EPI=0, BLOCK_N=8, PRE=2), 4, {}, ALIGN_R),
    ("rows_in_proj_conv", gemv.gemv_rows_kernel, dict(R, PRO=1, EPI=3, BLOCK_N=8, PRE=0), 4, {}, ALIGN_R),
    ("rows_gated_residual_prefetch", gemv.gemv_rows_kernel,
     dict(R, PRO=2, EPI=1, GROUP=128, KP=4096, BLOCK_N=8, BLOCK_K=1024, PRE=2), 8, {}, ALIGN_R),
    ("rows_residual_prefetch", gemv.gemv_rows_kernel, dict(R, PRO=0, EPI=1, BLOCK_N=2, BLOCK_K=1024, PRE=2), 4, {},
     ALIGN_R),
    ("rows_swiglu_prefetch", gemv.gemv_rows_kernel, dict(R, PRO=1, EPI=2, BLOCK_N=8, PRE=2), 4, {}, ALIGN_R),
    ("rows_lm_head_argmax_xn", gemv.gemv_rows_kernel, dict(R, PRO=1, EPI=4, STORE_XN=True, PRE=0), 4, ARGMAX, ALIGN_R),
    ("rows_router_xn_prefetch", gemv.gemv_rows_kernel,
     dict(R, PRO=1, EPI=0, STORE_XN=True, BLOCK_N=4, BLOCK_K=1024, PRE=2), 4, {}, ALIGN_R),
    ("rows_m3_conv", gemv.gemv_rows_kernel, dict(R, M=3, MP=4, PRO=1, EPI=3, BLOCK_N=8, PRE=0), 4, {}, ALIGN_R),
    # 4 drafts: M = 5 verify rows (padded to 8)
    ("rows_m5_conv", gemv.gemv_rows_kernel, dict(R, M=5, MP=8, PRO=1, EPI=3, BLOCK_N=8, PRE=0), 4, {}, ALIGN_R),
    ("rows_m5_gated_residual_prefetch", gemv.gemv_rows_kernel,
     dict(R, M=5, MP=8, PRO=2, EPI=1, GROUP=128, KP=4096, BLOCK_N=8, BLOCK_K=1024, PRE=2), 8, {}, ALIGN_R),
    # the tensor-core M-row kernel at the Tuning defaults (gemv_rows, lm_rows: rows, K block, warps, stages)
    ("rows_dot_swiglu", gemv.gemv_rows_dot_kernel, dict(RD, PRO=1, EPI=2, BLOCK_N=32, STAGES=3), 2, {}, ALIGN_R),
    ("rows_dot_residual", gemv.gemv_rows_dot_kernel, dict(RD, PRO=0, EPI=1, KP=8192, STAGES=5), 1, {}, ALIGN_R),
    ("rows_dot_conv", gemv.gemv_rows_dot_kernel, dict(RD, PRO=1, EPI=3, BLOCK_N=32, STAGES=3), 2, {}, ALIGN_R),
    ("rows_dot_lm_head_argmax_xn", gemv.gemv_rows_dot_kernel,
     dict(RD, PRO=1, EPI=4, STORE_XN=True, BLOCK_N=64, STAGES=3), 4, ARGMAX, ALIGN_R),
    ("rows_dot_m3_qkv", gemv.gemv_rows_dot_kernel, dict(RD, M=3, PRO=1, EPI=0, BLOCK_N=32, STAGES=3), 2, {}, ALIGN_R),
    # K split over two programs per tile (RowsShape.splits): the down projection, the SwiGLU's two halves
    ("rows_dot_split2_residual", gemv.gemv_rows_dot_kernel, dict(RD, PRO=0, EPI=1, KP=8192, STAGES=5, SPLITS=2), 1, {},
     ALIGN_R),
    ("rows_dot_split2_swiglu", gemv.gemv_rows_dot_kernel, dict(RD, PRO=1, EPI=2, STAGES=3, SPLITS=2), 1, {}, ALIGN_R),
    # Tuning.rows_l2_prefetch: the next GEMV's first weight bytes asked of L2 when a program is done
    ("rows_dot_swiglu_l2", gemv.gemv_rows_dot_kernel, dict(RD, PRO=1, EPI=2, BLOCK_N=32, STAGES=3, PF=1), 2, {},
     ALIGN_R),
    ("rows_gated_residual_l2", gemv.gemv_rows_kernel,
     dict(R, PRO=2, EPI=1, GROUP=128, KP=4096, BLOCK_N=8, BLOCK_K=1024, PRE=0, PF=1), 8, {}, ALIGN_R),
    # FP8 weights (published layout: 128 x 128 blocks; the GDN in_proj's b / a rows a bf16 tail)
    ("rows_fp8_dot_qkv", gemv.gemv_rows_dot_kernel, dict(RDF, PRO=1, EPI=0, BLOCK_N=32, STAGES=3), 2, F8, ALIGN_R),
    ("rows_fp8_dot_in_proj_conv_tail", gemv.gemv_rows_dot_kernel,
     dict(RDF, PRO=1, EPI=3, BLOCK_N=32, STAGES=3, TAIL=True), 2, F8, ALIGN_R),
    ("rows_fp8_dot_swiglu", gemv.gemv_rows_dot_kernel, dict(RDF, PRO=1, EPI=2, BLOCK_N=32, STAGES=3), 2, F8, ALIGN_R),
    ("rows_fp8_dot_residual_split2", gemv.gemv_rows_dot_kernel,
     dict(RDF, PRO=0, EPI=1, KP=8192, STAGES=5, SPLITS=2), 1, F8, ALIGN_R),
    ("rows_fp8_dot_per_row_scales", gemv.gemv_rows_dot_kernel,
     dict(RDF, PRO=1, EPI=0, BLOCK_N=32, STAGES=3, UNIFORM=False), 2, F8, ALIGN_R),
    # K blocks across scale blocks (or Tuning.fp8_round_weights): each e4m3 * scale rounded to bf16 first
    ("rows_fp8_dot_round_weights", gemv.gemv_rows_dot_kernel,
     dict(RDF, PRO=1, EPI=0, BLOCK_N=32, BLOCK_K=256, STAGES=3, ROUND_W=True), 2, F8, ALIGN_R),
    ("rows_fp8_dot_lm_head_argmax", gemv.gemv_rows_dot_kernel,
     dict(RDF, PRO=1, EPI=4, STORE_XN=True, BLOCK_N=64, STAGES=3), 4, F8_ARGMAX, ALIGN_R),
    ("rows_fp8_fold_gated_residual", gemv.gemv_rows_kernel,
     dict(RF, PRO=2, EPI=1, GROUP=128, KP=4096, BLOCK_N=8, BLOCK_K=1024, PRE=0), 8, F8, ALIGN_R),
    ("rows_fp8_fold_router_xn", gemv.gemv_rows_kernel,
     dict(RF, PRO=1, EPI=0, STORE_XN=True, BLOCK_N=4, PRE=0, UNIFORM=False, ROUND_W=True), 4, F8, ALIGN_R),
    ("qk_rope_cache_m", attention.qk_rope_cache_m_kernel, dict(H=8, KVH=2, HD=256, ROT=64, RESTP=256, HDP=256), 2,
     SPEC_T, ()),
    ("attn_verify_scores", attention.attn_verify_scores_kernel, AV, 4, SPEC_T, ()),
    ("attn_verify_pv_35b", attention.attn_verify_pv_kernel, dict(AV, H=16, G=8, RP=32), 4, SPEC_T, ()),
    ("attn_verify_pv_start_m1", attention.attn_verify_pv_kernel, dict(AV, M=1, HAS_START=True), 4, SPEC_T, ()),
    ("attn_verify_combine", attention.attn_verify_combine_kernel,
     dict(M=4, HAS_START=False, NSPLIT=128, MIN_PER=64, BLOCK=64, H=8, HD=256, BLOCK_D=64), 4, SPEC_T, ()),
    ("gdn_verify_1warp", gdn.gdn_verify_kernel, dict(M=4, HV=16, HK=16, DK=128, DV=128, BLOCK_V=16, PRE=False,
                                                  STORE=True), 1,
     SPEC_T, ()),
    ("gdn_verify_35b_prefetch", gdn.gdn_verify_kernel,
     dict(M=4, HV=32, HK=16, DK=128, DV=128, BLOCK_V=16, PRE=True, STORE=True), 1, SPEC_T, ()),
    ("gdn_commit", gdn.gdn_commit_kernel, dict(KM1=3, KM1P=4, BLOCK=4096, BLOCK_C=256, HAS_LIVE=False), 4, SPEC_T,
     ()),
    ("moe_gate_up_m4", moe.moe_gate_up_kernel, dict(MU, M=4), 1, SPEC_T, ALIGN_M),
    ("moe_down_m4", moe.moe_down_kernel, dict(MD, M=4), 1, SPEC_T, ALIGN_M),
    ("accept", spec.accept_kernel, dict(M=4, MP=4, BLOCK=16384, ASM=True, SYNTH=False, HAS_LIVE=False, RING_B=1), 8,
     SPEC_T, ()),
    # pinned acceptance (engine/spec/synthetic.py): the accepted count read from the host-filled ring
    ("accept_synthetic", spec.accept_kernel, dict(M=4, MP=4, BLOCK=16384, ASM=True, SYNTH=True, HAS_LIVE=False,
                                                  RING_B=1), 8, SPEC_T, ()),
    ("accept_m5", spec.accept_kernel, dict(M=5, MP=8, BLOCK=16384, ASM=True, SYNTH=False, HAS_LIVE=False, RING_B=1), 8,
     SPEC_T, ()),
    ("mtp_input", spec.mtp_input_kernel, dict(HP=2048), 4, SPEC_T, ()),
    # rows by a device index: the step's, the batch step's (live slots) and the verify's embeddings, each slot's
    # row of its accepted position
    ("gather_rows", sampling.gather_rows_kernel, dict(STEP=0, HAS_LIVE=False, BLOCK=1024), 4, {"idx_ptr": "*i64"}, ()),
    ("gather_rows_live", sampling.gather_rows_kernel, dict(STEP=0, HAS_LIVE=True, BLOCK=1024), 4,
     {"idx_ptr": "*i64", "live_ptr": "*i32"}, ()),
    ("gather_rows_step", sampling.gather_rows_kernel, dict(STEP=4, HAS_LIVE=False, BLOCK=1024), 4, {"idx_ptr": "*i64"},
     ()),
    ("draft_pick", spec.draft_pick_kernel, dict(BLOCK=8192, HAS_MAP=False, HAS_LIVE=False), 8, SPEC_T, ()),
    # a draft token map (engine/spec/draft_vocab.py): the argmax index mapped to its token id
    ("draft_pick_map", spec.draft_pick_kernel, dict(BLOCK=2048, HAS_MAP=True, HAS_LIVE=False), 4, SPEC_T, ()),
    # a pick fused with the next chained step's input (one request; the batched round's live slots)
    ("draft_pick_input", spec.draft_pick_input_kernel, dict(BLOCK=2048, HAS_MAP=True, HAS_LIVE=False, HP=2048), 4,
     SPEC_T, ()),
    ("draft_pick_input_slots", spec.draft_pick_input_kernel, dict(BLOCK=2048, HAS_MAP=True, HAS_LIVE=True, HP=2048),
     4, SPEC_T, ()),
]
# The batch step (engine/gpu/batch_decoder.py) over B = 8 slots (M = 8 rows; the 2B / 35B-A3B shapes at the
# Tuning defaults): the M-row GEMVs it launches, kernels/batch.py's per-slot kernels.
BT = {"live_ptr": "*i32", "tok_ptr": "*i64", "pos_ptr": "*i64", "step_ptr": "*i64", "ring_ptr": "*i64",
      "s_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "state_ptr": "*fp32",
      "wts_ptr": "*fp32", "ids_ptr": "*i32", "pmax_ptr": "*fp32", "pidx_ptr": "*i32"}
R8 = dict(RD, M=8, MP=8)
# kernels/batch.py gemv_rows_conv_kernel (the batch step's in_proj + per-slot conv)
BC = dict(KC=4, KCP=4, KP=2048, BLOCK_K=256, EVEN_K=True, FP8=False, BKS=1, UNIFORM=True, ROUND_W=False, TAIL=False)
ALIGN_B = ("x_ptr", "w_ptr", "y_ptr", "nw_ptr", "K", "stride_w", "stride_x", "stride_y")
BATCH_VARIANTS = [
    ("batch_rows8_qkv", gemv.gemv_rows_dot_kernel, dict(R8, PRO=1, EPI=0, BLOCK_N=32, STAGES=3), 2, {}, ALIGN_R),
    ("batch_rows8_swiglu", gemv.gemv_rows_dot_kernel, dict(R8, PRO=1, EPI=2, BLOCK_N=32, STAGES=3), 2, {}, ALIGN_R),
    ("batch_rows8_residual", gemv.gemv_rows_dot_kernel, dict(R8, PRO=0, EPI=1, KP=8192, STAGES=5), 1, {}, ALIGN_R),
    ("batch_rows8_gated_residual", gemv.gemv_rows_dot_kernel, dict(R8, PRO=2, EPI=1, GROUP=128, STAGES=5), 1, {},
     ALIGN_R),
    ("batch_rows8_router_xn", gemv.gemv_rows_dot_kernel, dict(R8, PRO=1, EPI=0, STORE_XN=True, STAGES=5), 1, {},
     ALIGN_R),
    ("batch_rows8_lm_head_argmax", gemv.gemv_rows_dot_kernel, dict(R8, PRO=1, EPI=4, BLOCK_N=64, STAGES=3), 4,
     ARGMAX, ALIGN_R),
    ("batch_rows2_qkv", gemv.gemv_rows_dot_kernel, dict(RD, M=2, MP=2, PRO=1, EPI=0, BLOCK_N=32, STAGES=3), 2, {},
     ALIGN_R),
    ("batch_rows_conv_dot", batch.gemv_rows_conv_kernel,
     dict(BC, M=8, MP=8, BLOCK_N=32, DOT=1, PRE=0, VEC=1, STAGES=3), 2, BT, ALIGN_B),
    ("batch_rows_conv_m3_dot", batch.gemv_rows_conv_kernel,
     dict(BC, M=3, MP=4, BLOCK_N=32, DOT=1, PRE=0, VEC=1, STAGES=3), 2, BT, ALIGN_B),
    ("batch_rows_conv_fold_prefetch", batch.gemv_rows_conv_kernel,
     dict(BC, M=4, MP=4, BLOCK_N=8, DOT=0, PRE=2, VEC=8), 4, BT, ALIGN_B),
    # an FP8 checkpoint's batch step: the in_proj's e4m3 rows and bf16 tail, the experts of the live rows
    ("batch_rows_conv_fp8_dot_tail", batch.gemv_rows_conv_kernel,
     dict(BC, M=8, MP=8, BLOCK_N=32, BLOCK_K=128, DOT=1, PRE=0, VEC=1, STAGES=3, FP8=True, BKS=128, TAIL=True), 2,
     dict(BT, **F8), ALIGN_B),
    ("batch_moe_gate_up_fp8", moe.moe_gate_up_fp8_kernel, dict(MF, BLOCK_N=2, BLOCK_K=256, M=8, HAS_LIVE=True), 1,
     dict(BT, **F8, live_ptr="*i32"), ALIGN_M),
    ("batch_moe_down_fp8", moe.moe_down_fp8_kernel, dict(MDF, M=8, HAS_LIVE=True), 1, dict(BT, **F8, live_ptr="*i32"),
     ALIGN_M),
    ("batch_qk_rope", batch.qk_rope_rows_kernel, dict(H=8, KVH=2, HD=256, ROT=64, RESTP=256, HDP=256), 2, BT, ()),
    ("batch_attn_scores", batch.attn_scores_rows_kernel, dict(A, NSPLIT=128, MIN_PER=64, G=4, BLOCK=64), 4, BT, ()),
    ("batch_attn_pv_35b", batch.attn_pv_rows_kernel, dict(A, NSPLIT=128, MIN_PER=64, G=8, BLOCK=64), 4, BT, ()),
    ("batch_attn_combine", batch.attn_combine_rows_kernel,
     dict(NSPLIT=128, MIN_PER=64, BLOCK=64, HD=256, BLOCK_D=64), 4, BT, ()),
    ("batch_gdn_step", batch.gdn_step_rows_kernel, dict(HV=16, HK=16, DK=128, DV=128, BLOCK_V=16, PRE=False), 1,
     BT, ()),
    ("batch_gdn_step_35b_prefetch", batch.gdn_step_rows_kernel,
     dict(HV=32, HK=16, DK=128, DV=128, BLOCK_V=16, PRE=True), 1, BT, ()),
    ("batch_moe_gate_up", moe.moe_gate_up_kernel, dict(MU, M=8, HAS_LIVE=True), 1, BT, ALIGN_M),
    ("batch_moe_down", moe.moe_down_kernel, dict(MD, M=8, HAS_LIVE=True), 1, BT, ALIGN_M),
    ("batch_finish", batch.finish_rows_kernel, dict(B=8, BLOCK=4096), 8, BT, ()),
]
# The batched round (engine/gpu/batch_round.py) over B = 8 slots x M = 4 positions (32 rows): its 32-row
# tensor-core GEMVs, kernels/batch_round.py's per-slot verify kernels, the per-slot accept / commit / pick.
R32 = dict(RD, M=32, MP=32)
CS = dict(R=32, RP=32, M=4, MP=4, KC=4, KCP=4, KP=2048, BLOCK_N=32, BLOCK_K=256, EVEN_K=True, DOT=1, STAGES=3,
          FP8=False, BKS=1, UNIFORM=True, ROUND_W=False, TAIL=False)
ROUND_VARIANTS = [
    ("round_rows32_qkv", gemv.gemv_rows_dot_kernel, dict(R32, PRO=1, EPI=0, BLOCK_N=32, STAGES=3), 2, {}, ALIGN_R),
    ("round_rows32_gated_residual", gemv.gemv_rows_dot_kernel, dict(R32, PRO=2, EPI=1, GROUP=128, BLOCK_K=1024,
                                                                     STAGES=2), 8, {}, ALIGN_R),
    # Tuning.gated_norm_rows: the GDN output norm of the 32 rows, then the plain out_proj
    ("round_gated_norm", gdn.gated_norm_rows_kernel, dict(GROUP=128, BLOCK=512), 4, {}, ()),
    ("round_rows32_residual", gemv.gemv_rows_dot_kernel, dict(R32, PRO=0, EPI=1, BLOCK_N=32, STAGES=3), 2, {},
     ALIGN_R),
    ("round_rows32_lm_head_argmax_xn", gemv.gemv_rows_dot_kernel,
     dict(R32, PRO=1, EPI=4, STORE_XN=True, BLOCK_N=64, STAGES=3), 4, ARGMAX, ALIGN_R),
    ("round_conv_slots", batch_round.gemv_conv_slots_kernel, dict(CS, ALL_SLOTS=False, PRO=1), 2, BT, ALIGN_B),
    # Tuning.conv_all_slots: the conv epilogue over the 32 rows at once; Tuning.norm_rows: the RMSNorm once per
    # row, then the in_proj over normed rows
    ("round_conv_all_slots", batch_round.gemv_conv_slots_kernel, dict(CS, ALL_SLOTS=True, PRO=1), 2, BT, ALIGN_B),
    ("round_conv_slots_normed", batch_round.gemv_conv_slots_kernel, dict(CS, ALL_SLOTS=True, PRO=0), 2, BT,
     ALIGN_B),
    ("round_conv_slots_fp8_tail", batch_round.gemv_conv_slots_kernel,
     dict(CS, ALL_SLOTS=True, PRO=1, BLOCK_K=128, FP8=True, BKS=128, TAIL=True), 2, dict(BT, **F8), ALIGN_B),
    ("round_rmsnorm_rows", gemv.rmsnorm_rows_kernel, dict(KP=2048, BLOCK_K=1024), 4, {}, ()),
    ("round_gdn_verify", batch_round.gdn_verify_rows_kernel,
     dict(M=4, HV=16, HK=16, DK=128, DV=128, BLOCK_V=16, STORE=True), 1, dict(BT, rec_ptr="*fp32"), ()),
    # Tuning.gdn_recommit: the verify keeps no states, the commit runs the accepted tokens again
    ("round_gdn_verify_nostore", batch_round.gdn_verify_rows_kernel,
     dict(M=4, HV=16, HK=16, DK=128, DV=128, BLOCK_V=16, STORE=False), 1, dict(BT, rec_ptr="*fp32"), ()),
    ("round_gdn_recommit", gdn.gdn_recommit_kernel,
     dict(DT=tl.bfloat16, A_DT=tl.bfloat16, HV=16, HK=16, DK=128, DV=128, BLOCK_V=16, KM1=3, KM1P=4, BLOCK_C=256,
          HAS_LIVE=True, M=4), 1, dict(BT, table_ptr="*i64", a_ptr="*i64", live_ptr="*i32"), ()),
    ("round_qk_rope", batch_round.qk_rope_rows_kernel, dict(M=4, H=8, KVH=2, HD=256, ROT=64, RESTP=256, HDP=256), 2,
     BT, ()),
    ("round_attn_scores", batch_round.attn_verify_scores_rows_kernel, AV, 4, dict(BT, start_ptr="*i64"), ()),
    ("round_attn_pv_head_m1", batch_round.attn_verify_pv_rows_kernel, dict(AV, M=1, HAS_START=True), 4,
     dict(BT, start_ptr="*i64"), ()),
    ("round_attn_combine", batch_round.attn_verify_combine_rows_kernel,
     dict(M=4, HAS_START=False, NSPLIT=128, MIN_PER=64, BLOCK=64, H=8, HD=256, BLOCK_D=64), 4,
     dict(BT, start_ptr="*i64"), ()),
    ("round_accept", spec.accept_kernel, dict(M=4, MP=4, BLOCK=16384, ASM=True, SYNTH=False, HAS_LIVE=True, RING_B=8),
     8, SPEC_T, ()),
    ("round_commit", gdn.gdn_commit_kernel, dict(KM1=3, KM1P=4, BLOCK=4096, BLOCK_C=256, HAS_LIVE=True), 4, SPEC_T,
     ()),
    ("round_draft_pick_map", spec.draft_pick_kernel, dict(BLOCK=2048, HAS_MAP=True, HAS_LIVE=True), 4, SPEC_T, ()),
]
out = {}
for pdl in (False, True):
    on = dict(PDL=pdl)
    for name, fn, consts, nw in [
        ("gemv_rmsnorm_swiglu", gemv.gemv_kernel, dict(G, PRE=0, PRO=1, EPI=2), 4),
        ("gemv_rmsnorm_conv", gemv.gemv_kernel, dict(G, PRE=0, PRO=1, EPI=3), 4),
        ("gemv_gated_residual", gemv.gemv_kernel, dict(G, PRE=0, PRO=2, EPI=1, GROUP=128, BLOCK_N=8, BLOCK_K=1024), 8),
        ("gemv_lm_head_argmax", gemv.gemv_kernel, dict(G, PRE=0, PRO=1, EPI=4, BLOCK_N=32), 4),
        ("gemv_router_xn", gemv.gemv_kernel, dict(G, PRE=0, PRO=1, EPI=0, STORE_XN=True, BLOCK_N=4, BLOCK_K=1024),
         8),
        # weights (and the GDN state) loaded ahead of the PDL wait (Tuning.prefetch)
        ("gemv_swiglu_prefetch", gemv.gemv_kernel, dict(G, PRE=2, PRO=1, EPI=2), 4),
        ("gemv_residual_prefetch", gemv.gemv_kernel, dict(G, PRE=4, PRO=0, EPI=1, BLOCK_N=2, BLOCK_K=1024), 4),
        ("gemv_gated_prefetch", gemv.gemv_kernel, dict(G, PRE=1, PRO=2, EPI=1, GROUP=128, BLOCK_N=8, BLOCK_K=1024), 8),
        ("gemv_residual_prefetch_l2", gemv.gemv_kernel, dict(G, PRE=2, PRO=0, EPI=1, PF=1), 4),
        ("gemv_conv_l2", gemv.gemv_kernel, dict(G, PRE=0, PRO=1, EPI=3, PF=2), 4),
        ("gdn_step_prefetch", gdn.gdn_step_kernel, dict(HV=32, HK=16, DK=128, DV=128, BLOCK_V=16, PRE=True), 1),
        ("moe_gate_up", moe.moe_gate_up_kernel, dict(MU, BLOCK_N=16), 4),
        ("moe_down", moe.moe_down_kernel, dict(MD, BLOCK_N=2), 4),
        # the GPU defaults (gpu/tuning.py Tuning): one-warp MoE and GDN programs
        ("moe_gate_up_1warp", moe.moe_gate_up_kernel, MU, 1),
        ("moe_down_1warp", moe.moe_down_kernel, MD, 1),
        ("gdn_step_1warp", gdn.gdn_step_kernel, dict(HV=32, HK=16, DK=128, DV=128, BLOCK_V=16, PRE=False), 1),
        ("gdn_step", gdn.gdn_step_kernel, dict(HV=32, HK=16, DK=128, DV=128, BLOCK_V=16, PRE=False), 4),
        ("qk_rope_cache", attention.qk_rope_cache_kernel, dict(H=16, KVH=2, HD=256, ROT=64, RESTP=256, HDP=256), 2),
        ("attn_scores", attention.attn_scores_kernel, A, 4),
        ("attn_pv", attention.attn_pv_kernel, A, 4),
        ("attn_combine", attention.attn_combine_kernel, dict(NSPLIT=256, MIN_PER=32, BLOCK=32, HD=256, BLOCK_D=64), 4),
        ("finish", sampling.finish_kernel, FIN, 4),
        # 2B vocabulary: 248320 logits, 122 tail programs of 2048
        ("finish_logprobs_mask", sampling.finish_kernel, dict(FIN, LP=True, CHECK=True), 4),
        ("tail_logprobs", sampling.tail_kernel, dict(TAIL, TOPK=True), 4),
        ("tail_mask", sampling.tail_kernel, dict(TAIL, MASK=True), 4),
        ("tail_mask_logprobs_write", sampling.tail_kernel, dict(TAIL, MASK=True, TOPK=True, WRITE=True), 4),
    ]:
        out[f"{name}{'_pdl' if pdl else ''}"] = compile_(fn, dict(consts, **on), nw, LP_TYPES)
    for name, fn, consts, nw, types, aligned in FP8_VARIANTS + SPEC_VARIANTS + BATCH_VARIANTS + ROUND_VARIANTS:
        consts = dict(consts, **on)
        stages = {"num_stages": consts.pop("STAGES")} if "STAGES" in consts else {}
        out[f"{name}{'_pdl' if pdl else ''}"] = compile_(fn, consts, nw, types,
                                                         [a for a in aligned if a in fn.arg_names], **stages)
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def compiled(compile_sm90):
    return compile_sm90(SCRIPT)


def test_every_kernel_builds_a_cubin(compiled):
    assert len(compiled) == 52 + 26 + 100 + 44 + 40 and all(v["cubin_bytes"] > 0 for v in compiled.values()), compiled


def test_tensor_core_rows_stream_the_weights_through_pipelined_copies(compiled):
    """The tensor-core M-row kernel: its weight tiles go global -> shared by asynchronous copies (the
    compiler's software pipeline) into tensor-core MMAs (warpgroup or warp)."""
    dots = {k: v for k, v in compiled.items() if k.startswith("rows_dot_")}
    assert len(dots) == 16
    for name, v in dots.items():
        assert v["cp_async"] > 0 and v["wgmma"] + v["mma"] > 0, (name, v)
        # the split-K fixup: one arrival count per program (a gpu-scope acq_rel atomic), only when split
        assert v["atomics"] == (1 if "_split" in name else 0), (name, v)


def test_fp8_rows_convert_e4m3_in_the_kernel(compiled):
    """The M-row GEMVs over FP8 weights convert e4m3 in the kernel (no bf16 copy of the weights); the tensor-core
    ones still stream the tiles through pipelined copies into MMAs."""
    fp8 = {k: v for k, v in compiled.items() if k.startswith("rows_fp8_")}
    assert len(fp8) == 18
    for name, v in fp8.items():
        assert v["e4m3_cvt"] > 0, (name, v)
        if "_dot_" in name:
            assert v["cp_async"] > 0 and v["wgmma"] + v["mma"] > 0, (name, v)
            assert v["atomics"] == (1 if "_split" in name else 0), (name, v)


def test_batch_step_gemvs_run_on_the_tensor_cores(compiled):
    """The batch step's M-row GEMVs at 2 and 8 rows, the batched round's at 32 (and the in_proj with the
    per-slot conv epilogue on its tensor-core path, slot by slot and all slots at once; over FP8 weights too)
    stream their weight tiles through pipelined copies into tensor-core MMAs."""
    dots = {k: v for k, v in compiled.items() if k.startswith(("batch_rows", "round_rows", "round_conv"))
            and "fold" not in k}
    assert len(dots) == 18 + 14 + 4
    for name, v in dots.items():
        assert v["cp_async"] > 0 and v["wgmma"] + v["mma"] > 0, (name, v)


def test_fp8_kernels_stream_e4m3_in_16_byte_loads(compiled):
    """Every FP8 variant converts e4m3 in the kernel (weight-only: no bf16 copy of the weights) and, at
    the aligned real shapes, reads its weight stream with 16-byte evict-first loads."""
    fp8 = {k: v for k, v in compiled.items() if k.startswith("fp8_")}
    assert len(fp8) == 26
    for name, v in fp8.items():
        assert v["e4m3_cvt"] > 0 and v["evict_first_v4"] > 0, (name, v)


def test_host_memory_ordering_is_compiled_in(compiled):
    """The system-scope fences and the volatile flag reads survive compilation: the finish orders its
    logprob stores before the token store only with logprobs on; only a masked tail polls the flag."""
    for pdl in ("", "_pdl"):
        assert compiled[f"finish_logprobs_mask{pdl}"]["fence_sys"] >= 1
        assert compiled[f"finish{pdl}"]["fence_sys"] == 0
        for name in ("accept", "accept_synthetic", "round_accept"):  # the round's tokens before its record
            assert compiled[f"{name}{pdl}"]["fence_sys"] >= 1
        assert compiled[f"tail_logprobs{pdl}"]["volatile_loads"] == 0
        for name in ("tail_mask", "tail_mask_logprobs_write"):
            assert compiled[f"{name}{pdl}"]["volatile_loads"] >= 1 and compiled[f"{name}{pdl}"]["fence_sys"] >= 1


def test_pdl_emits_the_grid_dependency_pair_and_only_with_pdl(compiled):
    for name, v in compiled.items():
        if name.endswith("_pdl"):
            assert v["griddep"] >= 2, (name, v)  # wait + launch_dependents
        else:
            assert v["griddep"] == 0, (name, v)


def test_only_prefetch_variants_load_before_the_pdl_wait(compiled):
    """With PDL a kernel may start while its predecessor still writes: nothing is read before the wait
    but what the prefetch variants read there on purpose (weights, the GDN state slice)."""
    for name, v in compiled.items():
        if name.endswith("_pdl"):
            if "_prefetch" in name:
                assert v["loads_before_wait"] > 0, (name, v)
            else:
                assert v["loads_before_wait"] == 0, (name, v)


def test_l2_prefetch_variants_ask_l2_once_per_segment(compiled):
    """Tuning.l2_prefetch: a GEMV with PF segments holds PF bulk L2 prefetches (thread 0's, after its
    epilogue); every other kernel none."""
    for name, v in compiled.items():
        want = 2 if name.startswith("gemv_conv_l2") else 1 if "_l2" in name else 0
        assert v["l2_prefetch"] == want, (name, v)
        if name.endswith("_pdl"):  # after the wait: the programs ask when done
            assert v["l2_before_wait"] == 0, (name, v)
