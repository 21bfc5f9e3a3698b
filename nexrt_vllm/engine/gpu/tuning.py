"""Launch shapes of the fused step: named shapes, the rules that pick one per GEMV, PDL on/off.

The defaults were chosen by on-device sweeps (benchmarks' launch-shape tuners, docs/GPU.md). A
shape given as a plain tuple (a sweep's candidate, a `--tuning` override) becomes its named type.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

from nexrt_vllm.engine.fp8 import FP8Weight


class GemvShape(NamedTuple):
    """One GEMV launch: output rows per program, K columns per loop step, warps per program."""
    block_n: int
    block_k: int
    num_warps: int


class RowsShape(NamedTuple):
    """One M-row GEMV launch (the speculative verify): `GemvShape`'s fields and the kernel, as pipeline
    stages of the tensor-core kernel (kernels/gemv_verify.py `gemv_rows_dot_kernel`; 0: the fold kernel
    `gemv_rows_kernel`); `splits`: programs per output tile, each over its share of K (tensor-core
    kernel only; a launch of few output rows otherwise has fewer programs than the GPU has SMs)."""
    block_n: int
    block_k: int
    num_warps: int
    stages: int
    splits: int = 1


class GemvRule(NamedTuple):
    """The shape of a GEMV with at most `max_rows` output rows (rules are tried in order)."""
    max_rows: int
    block_n: int
    block_k: int
    num_warps: int

    @property
    def shape(self) -> GemvShape:
        return GemvShape(self.block_n, self.block_k, self.num_warps)


class RowsRule(NamedTuple):
    """`GemvRule` for the M-row GEMVs: the shape a `RowsShape`."""
    max_rows: int
    block_n: int
    block_k: int
    num_warps: int
    stages: int
    splits: int = 1

    @property
    def shape(self) -> RowsShape:
        return RowsShape(self.block_n, self.block_k, self.num_warps, self.stages, self.splits)


NO_LIMIT = 1 << 62  # the last rule's max_rows

# field name -> the named type of a shape field, or (the rule type,) for a field of rules
_NAMED = {"gemv": (GemvRule,), "gemv_fp8": (GemvRule,), "gemv_rows": (RowsRule,), "gemv_rows_wide": (RowsRule,),
          "gemv_rows_fp8": (RowsRule,),
          "gemv_gated": GemvShape, "gemv_router": GemvShape, "gemv_gated_fp8": GemvShape,
          "gemv_router_fp8": GemvShape, "lm": GemvShape, "lm_fp8": GemvShape, "moe": GemvShape,
          "moe_down": GemvShape, "moe_fp8": GemvShape, "moe_down_fp8": GemvShape,
          "gemv_gated_rows": RowsShape, "lm_rows": RowsShape}


@dataclass(frozen=True)
class Tuning:
    """Launch shapes of the fused step and PDL on/off.

    `gemv`: rules, first match wins. Few output rows need few rows per program and long K blocks, so
    that enough programs stream enough bytes each."""
    gemv: tuple[GemvRule, ...] = (GemvRule(4096, 2, 1024, 4), GemvRule(10000, 8, 256, 4),
                                  GemvRule(NO_LIMIT, 16, 256, 4))
    # The speculative verify's M-row GEMVs (engine/gpu/spec_round.py): the same rules plus the kernel;
    # its GDN out_proj and lm_head. The best per launch group of sweeps at two shapes (docs/GPU.md).
    gemv_rows: tuple[RowsRule, ...] = (RowsRule(4096, 16, 256, 1, 5), RowsRule(10000, 32, 256, 2, 3),
                                       RowsRule(NO_LIMIT, 32, 256, 2, 3))
    # The batched round's GEMVs over more than 8 rows (B slots x M positions, up to 32); empty: `gemv_rows`.
    # `gemv_rows` with K split over two programs for N <= 4096 (the N = 2048 MLP down, GDN out_proj, o_proj,
    # head fc: 128 programs of one warp, fewer than the GPU's SMs): the H200 sweep's best of five
    # (benchmarks/results/gpu/round_knobs_2b_h200.json; with gdn_recommit, B = 8 round 2,927 -> 2,794 µs,
    # B = 4 2,339 -> 2,261; decode_bench B = 8 2.934 -> 2.808 ms, B = 4 2.344 -> 2.265). At 4 rows (the
    # one-request round) the same split lost (1,959 -> 2,004 µs), so `gemv_rows` keeps one split.
    gemv_rows_wide: tuple[RowsRule, ...] = (RowsRule(4096, 16, 256, 1, 5, 2), RowsRule(10000, 32, 256, 2, 3),
                                            RowsRule(NO_LIMIT, 32, 256, 2, 3))
    gemv_gated_rows: RowsShape = RowsShape(8, 1024, 8, 0)
    lm_rows: RowsShape = RowsShape(64, 256, 4, 3)
    gemv_gated: GemvShape = GemvShape(8, 1024, 8)  # GDN out_proj (gated-norm prologue)
    # M-row GDN out_projs of at least this many rows (the batch step's slots, the batched round's
    # slots x positions, the one-request round's positions) normalize in a launch of their own
    # (kernels/gdn.py `gated_norm_rows`) and then run the plain M-row GEMV: each program of the gated
    # launch recomputes the norm of every row, which at 8 rows cost the batch step several times the
    # weight stream (docs/GPU.md "Several requests per round"). 4: the one-request round's 4 positions
    # too (H100 sweep: round 2,444 -> 2,356 µs, 1.42x the step; the batch step at B = 4 1.27x -> 1.20x B = 1).
    gated_norm_rows: int = 4
    # The batched round's GDN in_proj + conv: the conv epilogue over every slot's rows in one pass instead
    # of slot after slot (kernels/batch_round.py `_conv_all_slots`). At B = 8 the in_proj + conv took
    # 755 µs against the MLP gate/up's 680 for 1.5x its weight bytes (H100, 2B): B dependent rounds of
    # loads, barriers and stores per program. On since the H100 sweep (benchmarks/results/gpu/
    # batch_round_sweep_2b_h100.json): with norm_rows 16 it took the B = 8 round 3,778 -> 3,770 µs.
    conv_all_slots: bool = True
    # The speculative rounds' GDN verify (the one-request round's and the batched round's) keeps no state
    # per position; the commit runs the accepted tokens again over the live state, every GDN layer in one
    # launch (kernels/gdn.py `Recommit`; each GDN layer then keeps its own verify rows of [q|k|v|z|b|a]
    # until the commit). The verify's B x M state writes (4 MiB a slot and layer at 2B; 576 MiB a round at
    # B = 8) become B state writes at the commit, and 18 commit launches one. H200, decode_bench at 8K
    # (round_knobs_2b_h200.json): 2B round 1.916 -> 1.864 ms, B = 8 3.154 -> 2.934; 35B-A3B 5.362 -> 5.218.
    gdn_recommit: bool = True
    # The batched round's launch choices (GEMV shapes and kernels, the norm in a launch of its own) follow
    # the rows of the replay's bucket, so one live slot runs the one-request round's choices (its in_proj +
    # conv launch, one-row GEMVs in the head's chained steps). With the choices of its 8 slots' 32 rows an
    # 8-slot node's one-slot round took 2.574 ms where the one-request round takes 2.245 (H100, 2B, 8K,
    # decode_bench --batch-slots 8; the bucket's own GEMV shapes alone: 2.506). True:
    # they follow the node's capacity in every bucket, so a request's arithmetic (not only its greedy
    # tokens) does not depend on how many requests share the node, at that cost.
    batch_invariant: bool = False
    # The batched round's RMSNorm GEMVs (GDN in_proj + conv, attention qkv, dense gate/up, lm_head; the
    # verify's and the MTP head's pass over B x M rows) at this many rows or more: the norm once per row
    # in a launch of its own (kernels/gemv.py `rmsnorm_rows`), then plain GEMVs. In the fused prologue
    # every program re-reads all the rows twice (rstd, then the normed blocks): at 32 rows and 32 weight
    # rows a program, twice its weight bytes. 16 (B >= 4; the one-request round's 4 rows keep the fused
    # prologue): the H100 sweep's largest single gain, B = 8 round 4,326 -> 3,778 µs, B = 4 3,145 -> 2,968.
    norm_rows: int = 16
    gemv_router: GemvShape = GemvShape(4, 1024, 4)  # MoE router (E+1 rows)
    lm: GemvShape = GemvShape(16, 256, 4)  # lm_head + argmax partials
    attn_splits: int = 128
    # The K/V splits per request of the batch step and the batched round (0: attn_splits): their grids
    # have one more axis over the slots, so B requests launch B times the programs of one (the H100's
    # batched round at B = 8 spent 535 µs in attention over ~130 µs of K/V bytes). 64: the H100 sweep's
    # best with the two knobs above (B = 8 round 3,657 µs, B = 4 2,896; 32 was close, 256 lost).
    batch_attn_splits: int = 64
    # The K/V splits of the one-request speculative round's attention (its verify's M rows, the MTP head's
    # passes; 0: attn_splits, which the plain step keeps). 64: the H200 sweep put it 20-30 µs a round ahead
    # of 128 at 2B, 8K (round_knobs_2b_h200.json), and the H100's process-separated A/B 20 µs (2.206 ->
    # 2.186 ms; 32 no gain; round_knobs_ab_h100.json).
    round_attn_splits: int = 64
    attn_block: int = 64
    attn_min_per: int = 64
    attn_warps: int = 4
    gdn_block_v: int = 16
    # One-warp programs for the GDN step and the MoE experts: their reductions (the L2 norms, the
    # top-k picks of the routing, the per-expert dot products) stay in warp shuffles, no CTA barrier
    # between a program's loads and its arithmetic.
    gdn_warps: int = 1
    moe: GemvShape = GemvShape(2, 256, 1)  # experts' gate_up (and the shared expert's)
    moe_down: GemvShape = GemvShape(1, 512, 1)  # experts' down
    # Programmatic dependent launch for every kernel of the step (kernels/common.py) where the GPU has
    # it (`pdl_enabled`); None: the process default (NEXRT_PDL). With the small programs above, a
    # kernel's CTAs can be resident while its predecessor drains.
    pdl: bool | None = True
    # With PDL: K blocks of its bf16 weight rows each GEMV program loads before it waits on the
    # previous kernel, and (when > 0) the GDN step's state slice too; what neither depends on the
    # previous kernel streams while it drains. 0: every load after the wait. GEMVs over fp8 weights
    # load nothing early: it did not make their step faster.
    prefetch: int = 2
    prefetch_conv: int = 0  # the same for the GDN in_proj + conv launches, tuned on its own
    # Columns each GEMV / MoE thread sums in registers before accumulating (kernels/gemv_step.py `_fold`):
    # 0 the elements of one 16-byte load (8 bf16, 16 e4m3), 1 elementwise accumulators. `vec` for
    # bf16 weights (the fold was no faster there), `vec_fp8` for fp8 ones (their fp32 accumulators
    # were what limited the bytes in flight, and the fold frees those registers).
    vec: int = 1
    # Logprobs / grammar masks: logits per program of the tail launch, and how many reads of the
    # host's mask flag a step makes before it gives up on the mask (each read crosses PCIe).
    tail_chunk: int = 2048
    mask_spin: int = 1 << 21
    # FP8 weights (fp8.FP8Weight, e4m3 + block scales; docs/GPU.md "FP8"): the same rules for the
    # fp8 kernels, chosen by their own sweeps (16 e4m3 per thread and load).
    gemv_fp8: tuple[GemvRule, ...] = (GemvRule(4096, 4, 2048, 4), GemvRule(10000, 16, 512, 4),
                                      GemvRule(NO_LIMIT, 16, 512, 4))
    gemv_gated_fp8: GemvShape = GemvShape(8, 2048, 8)
    gemv_router_fp8: GemvShape = GemvShape(4, 2048, 8)
    lm_fp8: GemvShape = GemvShape(32, 512, 4)
    moe_fp8: GemvShape = GemvShape(8, 512, 2)
    moe_down_fp8: GemvShape = GemvShape(2, 256, 1)
    vec_fp8: int = 0
    # The M-row GEMVs (speculative verify, batch decoders) over fp8 weights: the fold kernel (each column's scale
    # into x, as the one-row fp8 kernel). H100, MTP round at 8K, 32K drafts, random weights (benchmarks/results/
    # gpu/spec_fp8_h100.json): 2B 2.451 ms, 35B-A3B (20 layers) 2.723; with K blocks of 2048: 2.555 / 2.757; on the
    # tensor-core kernel (e4m3 tiles of 128 columns into the MMA, sums scaled per block) 2.618-2.840 / 3.265, with
    # each weight dequantized to bf16 first 3.492 at 2B. Empty: the `gemv_fp8` shapes on the fold kernel.
    gemv_rows_fp8: tuple[RowsRule, ...] = (RowsRule(4096, 4, 1024, 4, 0), RowsRule(10000, 16, 512, 4, 0),
                                           RowsRule(NO_LIMIT, 16, 512, 4, 0))
    # Round every e4m3 * scale to bf16 in the kernels, as the eager oracle's dequantized weights are:
    # the fp8 step then differs from the eager one only in the order of sums (parity diagnostics).
    fp8_round_weights: bool = False
    # Bytes of the next GEMV's weight each M = 1 GEMV launch over bf16 weights asks L2 for as its
    # programs finish (kernels/common.py `l2_prefetch`, `FusedDecoder._l2_plan`); 0: none. The next
    # weight's first bytes are then in L2 when its launch starts, which shortens a dense model's
    # step; asking for much more made it slower. MoE models ask nothing (their step was not reliably
    # faster with it), nor do GEMVs over fp8 weights (theirs was slower).
    l2_prefetch: int = 1 << 20
    # The same for the speculative round's verify (gpu/spec_round.py): bytes of the next M-row GEMV's weight each
    # M-row GEMV over bf16 weights asks L2 for as its programs finish; 0: none. H100, 2B, 8K, alternated runs
    # (benchmarks/results/gpu/rows_l2_prefetch_h100.json): round 2.230 -> 2.219 / 2.202 / 2.176 / 2.176 ms at
    # 1 / 2 / 4 / 8 MiB (fp8 head 2.136 -> 2.083 at 4 MiB), the step unchanged.
    rows_l2_prefetch: int = 4 << 20

    def __post_init__(self):
        for f in fields(self):
            kind, v = _NAMED.get(f.name), getattr(self, f.name)
            if isinstance(kind, tuple):
                object.__setattr__(self, f.name, tuple(kind[0](*r) for r in v))
            elif kind is not None:
                object.__setattr__(self, f.name, kind(*v))

    def shape(self, n: int, fp8: bool = False, rows: bool = False, wide: bool = False) -> GemvShape | RowsShape:
        """The shape of a GEMV with `n` output rows over bf16 or `fp8` weights; `rows`: an M-row GEMV's
        (`gemv_rows` / `gemv_rows_fp8`; by the `gemv` / `gemv_fp8` rules with the fold kernel when that is empty);
        `wide`: over more than 8 rows (`gemv_rows_wide` when it has rules; bf16 weights)."""
        if rows and wide and self.gemv_rows_wide and not fp8:
            rules = self.gemv_rows_wide
        elif fp8:
            rules = self.gemv_rows_fp8 if rows and self.gemv_rows_fp8 else self.gemv_fp8
        else:
            rules = self.gemv_rows if rows and self.gemv_rows else self.gemv
        for rule in rules:
            if n <= rule.max_rows:
                s = rule.shape
                return RowsShape(*s, 0) if rows and isinstance(s, GemvShape) else s
        raise AssertionError("unreachable: the last gemv rule has no row limit")

    @property
    def spec_attn_splits(self) -> int:
        """The K/V splits of the one-request speculative round (`round_attn_splits`, else `attn_splits`)."""
        return self.round_attn_splits or self.attn_splits

    @property
    def slot_attn_splits(self) -> int:
        """The K/V splits per request of the batch decoders (`batch_attn_splits`, else `attn_splits`)."""
        return self.batch_attn_splits or self.attn_splits


def tuning_overrides(kvs: str) -> tuple[Tuning, dict]:
    """"field=value,..." -> (the default Tuning with those fields replaced, the replaced fields): ints, 0/1 for
    bools, a/b/c tuples, a/b/c+d/e/f tuples of tuples (e.g. the `gemv` rules). ValueError naming the field
    for an unknown field, a value that is not a number, or a shape of the wrong length."""
    import dataclasses

    types = {f.name: f.type for f in fields(Tuning)}
    kw = {}
    for kv in filter(None, kvs.split(",")):
        k, _, v = kv.partition("=")
        if k not in types:
            raise ValueError(f"unknown Tuning field {k!r}; fields: {sorted(types)}")
        try:
            if "+" in v:
                kw[k] = tuple(tuple(int(x) for x in part.split("/")) for part in v.split("+"))
            elif "/" in v:
                kw[k] = tuple(int(x) for x in v.split("/"))
            elif types[k] in ("bool", "bool | None"):
                kw[k] = v.lower() in ("1", "true")
            else:
                kw[k] = int(v)
        except ValueError:
            raise ValueError(f"Tuning field {k}: {v!r} is not a number, a/b/c or a/b/c+d/e/f") from None
    try:
        return dataclasses.replace(Tuning(), **kw), kw
    except TypeError as e:  # a shape tuple of the wrong length
        raise ValueError(f"Tuning overrides {kvs!r}: {e}") from None


def gemv_kwargs(t: Tuning, w, shape: GemvShape | RowsShape, prefetch: int | None = None) -> dict:
    """The `kernels.gemv.gemv` keywords of a launch of `shape` over the weight `w` (bf16, or an
    fp8.FP8Weight, whose fp8 rows before a bf16 tail must fill whole programs). `prefetch`: K blocks
    of a bf16 `w` ahead of the wait (None: `t.prefetch`; fp8 weights and the tensor-core M-row kernel load none
    early)."""
    kw = {"block_n": shape.block_n, "block_k": shape.block_k, "num_warps": shape.num_warps}
    if isinstance(shape, RowsShape):
        kw["dot"] = shape.stages
        if shape.splits != 1:
            kw["splits"] = shape.splits
    if isinstance(w, FP8Weight):
        kw.update(vec=t.vec_fp8, round_w=t.fp8_round_weights)
        if w.tail is not None:
            kw["block_n"] = min(kw["block_n"], w.n8 & -w.n8)
        return kw
    return {**kw, "prefetch": t.prefetch if prefetch is None else prefetch, "vec": t.vec}


def moe_kwargs(t: Tuning, cfg, f) -> dict:
    """The `kernels.moe.moe_experts` keywords of the MoE block `f` (gpu/fusion.py MoEFFN; bf16 or fp8 experts): the
    Tuning shapes of each weight format, the routing's top-k."""
    up8 = isinstance(f.gate_up, FP8Weight) or isinstance(f.s_gate_up, FP8Weight)
    dn8 = isinstance(f.down, FP8Weight) or isinstance(f.s_down, FP8Weight)
    up, dn = t.moe_fp8 if up8 else t.moe, t.moe_down_fp8 if dn8 else t.moe_down
    return dict(top_k=cfg.num_experts_per_tok, block_n=up.block_n, block_k=up.block_k, down_block_n=dn.block_n,
                down_block_k=dn.block_k, num_warps=up.num_warps, down_num_warps=dn.num_warps,
                norm_topk=cfg.norm_topk_prob, round_w=t.fp8_round_weights, vec=t.vec_fp8 if up8 or dn8 else t.vec)


def pdl_enabled(requested: bool | None, process_default: bool, capability: tuple[int, int] | None) -> bool:
    """Whether the step's kernels launch with PDL: as requested (None: the process default), and only
    on a device that has it (compute capability 9.0+, Hopper; None: not a CUDA device). The kernels
    then carry `griddepcontrol`, which an older GPU cannot run."""
    want = process_default if requested is None else requested
    return bool(want) and capability is not None and capability >= (9, 0)
