"""Checkpoint loading (safetensors, single file or sharded) and random weights for benchmarks.

Tensors are returned under canonical names: the text model's Hugging Face names without the
`model.` / `model.language_model.` prefix (`embed_tokens.weight`, `layers.3.self_attn.q_proj.weight`,
`lm_head.weight`, ...). MoE experts are stacked as transformers 5 keeps them in memory:
`layers.i.mlp.experts.gate_up_proj` [E, 2I, H] (gate rows then up rows) and
`layers.i.mlp.experts.down_proj` [E, H, I]; a checkpoint may store them that way or per expert
(`experts.{j}.gate_proj.weight`, ...). `mtp.*` tensors are kept apart, unvalidated.

FP8 checkpoints (config `quantization_config.quant_method == "fp8"`, see config.FP8BlockQuant) store
Linear weights as float8_e4m3fn next to `<name>_scale_inv` (one scale per block: fp32, or bf16 as the
Qwen releases store it, widened exactly to fp32); they are dequantized block-wise here into the
engine's dtype, so everything downstream sees float weights - or, with `keep_fp8`, the projections
the GPU kernels read stay e4m3 + scales (`fp8.FP8Weight`) and the rest is dequantized.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from collections.abc import Callable

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from nexrt_vllm.engine import fp8
from nexrt_vllm.engine.config import ModelConfig
from nexrt_vllm.engine.errors import WeightsError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Stripped from checkpoint names, longest first (Qwen3.5 VL checkpoints nest the text model).
PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.")
LOADABLE_DTYPES = {"F32", "BF16", "F16"}
FP8_DTYPE = "F8_E4M3"  # safetensors' name for torch.float8_e4m3fn
SCALE_DTYPES = {"F32", "BF16"}  # both widen to fp32 exactly
SCALE_SUFFIX = "_scale_inv"
EXPERT_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_MAX_LISTED = 40


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by canonical name."""
    H, V = cfg.hidden_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (V, H), "norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if kind == "full_attention":
            a, hd = p + "self_attn.", cfg.head_dim
            shapes.update({
                a + "q_proj.weight": (2 * cfg.num_heads * hd, H),  # [query | gate] per head
                a + "k_proj.weight": (cfg.num_kv_heads * hd, H),
                a + "v_proj.weight": (cfg.num_kv_heads * hd, H),
                a + "o_proj.weight": (H, cfg.num_heads * hd),
                a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,),
            })
        else:
            g, nv = p + "linear_attn.", cfg.linear_num_value_heads
            if cfg.family == "qwen3_next":
                shapes[g + "in_proj_qkvz.weight"] = (2 * cfg.key_dim + 2 * cfg.value_dim, H)
                shapes[g + "in_proj_ba.weight"] = (2 * nv, H)
            else:
                shapes.update({g + "in_proj_qkv.weight": (cfg.conv_dim, H), g + "in_proj_z.weight": (cfg.value_dim, H),
                               g + "in_proj_b.weight": (nv, H), g + "in_proj_a.weight": (nv, H)})
            shapes.update({
                g + "conv1d.weight": (cfg.conv_dim, 1, cfg.conv_kernel),
                g + "dt_bias": (nv,), g + "A_log": (nv,),
                g + "norm.weight": (cfg.linear_value_head_dim,),
                g + "out_proj.weight": (H, cfg.value_dim),
            })
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            E, I, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            shapes.update({
                m + "gate.weight": (E, H),
                m + "experts.gate_up_proj": (E, 2 * I, H),
                m + "experts.down_proj": (E, H, I),
                m + "shared_expert.gate_proj.weight": (S, H),
                m + "shared_expert.up_proj.weight": (S, H),
                m + "shared_expert.down_proj.weight": (H, S),
                m + "shared_expert_gate.weight": (1, H),
            })
        else:
            I = cfg.intermediate_size
            shapes.update({m + "gate_proj.weight": (I, H), m + "up_proj.weight": (I, H),
                           m + "down_proj.weight": (H, I)})
    return shapes


def _listing(title: str, items: list[str]) -> str:
    shown = items[:_MAX_LISTED]
    more = f"\n    ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"  {title} ({len(items)}):\n" + "\n".join(f"    {s}" for s in shown) + more


def _checkpoint_files(path: str) -> dict[str, str]:
    """checkpoint tensor name -> file holding it, from the shard index or the single file."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(f"bad index file {index}: not valid JSON ({e})") from None
        except (KeyError, TypeError):
            raise WeightsError(f"bad index file {index}: no 'weight_map' object") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise WeightsError(f"bad index file {index}: 'weight_map' must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if absent:
            raise WeightsError(f"bad index file {index}: it names shard files that do not exist: {absent}")
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.isfile(single):
        raise WeightsError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    try:
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for corrupt headers
        raise WeightsError(f"cannot read {single}: {e}") from None


def _canonical(name: str) -> str:
    for p in PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def fp8_scale_shape(shape: list[int] | tuple[int, ...], block_n: int, block_k: int) -> tuple[int, ...]:
    """The `_scale_inv` shape of a block-quantized weight [..., N, K]: [..., ceil(N/bn), ceil(K/bk)]."""
    *lead, n, k = shape
    return (*lead, -(-n // block_n), -(-k // block_k))


def dequant_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """fp32 weight = e4m3 weight * its block's scale_inv (scales repeated over blocks, cropped to N x K)."""
    n, k = weight.shape[-2:]
    s = scale_inv.float().repeat_interleave(block_n, dim=-2).repeat_interleave(block_k, dim=-1)
    return weight.float() * s[..., :n, :k]


def _not_converted(module: str, patterns: tuple[str, ...]) -> bool:
    # transformers' rule (quantizers_utils.should_convert_module), so both read the list alike.
    return any(re.match(f"{p}\\.", module) or re.match(p, module) or module.endswith(p) for p in patterns)


def load_checkpoint(path: str, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu",
                    progress: bool = True, keep_fp8: bool = False,
                    shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Read, validate and cast every tensor; returns (canonical tensors, mtp tensors).

    All problems (missing, unexpected, misshaped, unsupported dtype) are reported in one WeightsError.
    `keep_fp8`: float8 projections the GPU kernels read (fp8.keepable) are returned as fp8.FP8Weight
    (stacked experts too, when every expert's gate / up / down is float8; else that stack is
    dequantized); the head stays dequantized when the embeddings are tied.
    `shard(canonical name, tensor)`: each decoder tensor as read (an expert's gate / up / down under
    `layers.L.mlp.experts.J.{gate,up,down}_proj.weight`, before the stack), on the host (an fp8 one
    after its dequantization on `device`) and before it moves to `device`: what a tensor-parallel rank
    keeps (tp.shard_tensor). The MTP tensors are not passed through it. Not with `keep_fp8`.
    """
    if shard is not None and keep_fp8:
        raise ValueError("load_checkpoint: shard= reads bf16 shards; keep_fp8 is for one device")
    name_to_file = _checkpoint_files(path)

    # Inspect headers only (shape, dtype) before reading any data.
    headers: dict[str, tuple[list[int], str]] = {}
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, file in name_to_file.items():
        by_file[file].append(name)
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="pt") as f:
                present = set(f.keys())
                for n in names:
                    if n in present:
                        sl = f.get_slice(n)
                        headers[n] = (list(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # noqa: BLE001
            raise WeightsError(f"cannot read {file}: {e}") from None

    quant = cfg.quantization
    loadable = LOADABLE_DTYPES | ({FP8_DTYPE} if quant is not None else set())
    # FP8: every e4m3 tensor needs its `_scale_inv` (any shard), of the block grid's shape.
    scales: dict[str, str] = {}  # fp8 checkpoint name -> its scale's name
    scale_problems: dict[str, list[str]] = defaultdict(list)
    if quant is not None:
        for name in sorted(headers):
            shape, dt = headers[name]
            if name.endswith(SCALE_SUFFIX):
                w = name[:-len(SCALE_SUFFIX)]
                if w not in headers or headers[w][1] != FP8_DTYPE:
                    scale_problems["unexpected"].append(f"{name} (a scale, but {w} is not a float8 tensor "
                                                        f"in the checkpoint)")
                continue
            if dt != FP8_DTYPE:
                continue
            sname = name + SCALE_SUFFIX
            module = name[:-len(".weight")] if name.endswith(".weight") else name
            if len(shape) not in (2, 3):
                scale_problems["unsupported dtype"].append(
                    f"{name}: float8 tensor of shape {tuple(shape)}; only Linear weights [N, K] "
                    f"(or stacked experts [E, N, K]) may be float8")
            elif _not_converted(module, quant.modules_to_not_convert):
                scale_problems["unsupported dtype"].append(
                    f"{name}: stored as float8 but listed in quantization_config.modules_to_not_convert")
            elif sname not in headers:
                scale_problems["missing"].append(f"{sname} (the block scales of float8 tensor {name})")
            elif headers[sname][1] not in SCALE_DTYPES:
                scale_problems["unsupported dtype"].append(f"{sname}: {headers[sname][1]} (scales must be F32 or BF16)")
            elif tuple(headers[sname][0]) != fp8_scale_shape(shape, quant.block_n, quant.block_k):
                scale_problems["wrong shape"].append(
                    f"{sname}: checkpoint {tuple(headers[sname][0])}, expected "
                    f"{fp8_scale_shape(shape, quant.block_n, quant.block_k)} for {name} {tuple(shape)} "
                    f"with weight_block_size [{quant.block_n}, {quant.block_k}]")
            else:
                scales[name] = sname

    expected = expected_shapes(cfg)
    visual_ok = cfg.architecture.endswith("ForConditionalGeneration")
    plan: dict[str, str] = {}  # canonical -> checkpoint name
    experts: dict[tuple[int, str], dict[int, str]] = defaultdict(dict)  # (layer, proj) -> expert -> name
    mtp_names: list[str] = []
    missing, unexpected, misshaped, bad_dtype = [], [], [], []
    seen: set[str] = set()
    for name in sorted(name_to_file):
        if name not in headers:
            missing.append(f"{name} (listed in the index but absent from {os.path.basename(name_to_file[name])})")
            continue
        if visual_ok and name.startswith(VISION_PREFIXES):
            continue  # the vision tower of a VL checkpoint: not part of the text decoder
        if quant is not None and name.endswith(SCALE_SUFFIX):
            continue  # paired with its weight above
        shape, dt = headers[name]
        if dt not in loadable:
            bad_dtype.append(f"{name}: {dt}")
        if name.startswith("mtp."):
            mtp_names.append(name)
            continue
        canon = _canonical(name)
        if canon == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding is the head
        m = EXPERT_RE.match(canon)
        if m and f"layers.{m[1]}.mlp.experts.down_proj" in expected:
            experts[(int(m[1]), m[3])][int(m[2])] = name
            continue
        if canon not in expected:
            unexpected.append(name)
            continue
        seen.add(canon)
        if tuple(shape) != expected[canon]:
            misshaped.append(f"{name}: checkpoint {tuple(shape)}, expected {expected[canon]}")
        else:
            plan[canon] = name

    # Per-expert tensors stand in for the stacked ones.
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    per_expert_shape = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    stacked: dict[str, list[list[str]]] = {}
    for layer in range(cfg.num_layers):
        got = {proj: experts.get((layer, proj), {}) for proj in per_expert_shape}
        if not any(got.values()):
            continue
        for proj, by_idx in got.items():
            for j in sorted(by_idx):
                n = by_idx[j]
                if j >= cfg.num_experts:
                    unexpected.append(n)
                elif tuple(headers[n][0]) != per_expert_shape[proj]:
                    misshaped.append(f"{n}: checkpoint {tuple(headers[n][0])}, expected {per_expert_shape[proj]}")
            for j in range(cfg.num_experts):
                if j not in by_idx:
                    missing.append(f"layers.{layer}.mlp.experts.{j}.{proj}_proj.weight")
        p = f"layers.{layer}.mlp.experts."
        if p + "gate_up_proj" in plan or p + "down_proj" in plan:
            unexpected.append(f"{p}* (both stacked and per-expert tensors for layer {layer})")
        stacked[p + "gate_up_proj"] = [[got["gate"].get(j), got["up"].get(j)] for j in range(cfg.num_experts)]
        stacked[p + "down_proj"] = [[got["down"].get(j)] for j in range(cfg.num_experts)]

    missing += [n for n in expected if n not in seen and n not in stacked]
    missing += scale_problems["missing"]
    unexpected += scale_problems["unexpected"]
    misshaped += scale_problems["wrong shape"]
    bad_dtype += scale_problems["unsupported dtype"]
    if quant is None and any(dt == FP8_DTYPE for _, dt in headers.values()):
        bad_dtype.append("(float8 tensors need config.json quantization_config with quant_method 'fp8')")
    problems = [(t, items) for t, items in (("missing", missing), ("unexpected", unexpected),
                                             ("wrong shape", misshaped), ("unsupported dtype", bad_dtype)) if items]
    if problems:
        raise WeightsError(f"checkpoint {path} does not match {cfg.architecture} config:\n"
                           + "\n".join(_listing(t, items) for t, items in problems))

    tensors: dict[str, torch.Tensor] = {}
    mtp: dict[str, torch.Tensor] = {}
    want: dict[str, list[str]] = defaultdict(list)  # file -> checkpoint names to read
    for n in list(plan.values()) + mtp_names + [x for groups in stacked.values() for g in groups for x in g]:
        want[name_to_file[n]].append(n)
    # Scales first: a weight and its scale may sit in different shards.
    scale_of: dict[str, torch.Tensor] = {}
    scale_files: dict[str, list[str]] = defaultdict(list)
    for n in (x for names in want.values() for x in names):
        if n in scales:
            scale_files[name_to_file[scales[n]]].append(n)
    for file, names in scale_files.items():
        with safe_open(file, framework="pt") as f:
            for n in names:
                scale_of[n] = f.get_tensor(scales[n])
    head = set(mtp_names)  # not sharded: the MTP head stays whole
    raw: dict[str, torch.Tensor] = {}
    bar = tqdm(total=sum(len(v) for v in want.values()), desc="Loading weights", unit="tensor",
               disable=not progress)
    keep: set[str] = set()  # checkpoint names returned as FP8Weight
    if keep_fp8 and quant is not None:
        keep = {n for canon, n in plan.items() if n in scales and fp8.keepable(canon)}
        for canon, groups in stacked.items():
            names = [x for g in groups for x in g]
            if all(x in scales for x in names):
                keep.update(names)
        # the MTP head as the checkpoint stores it: its fp8 projections, and its experts when all are fp8
        keep.update(n for n in mtp_names if n in scales and fp8.keepable(n))
        head_experts = [n for n in mtp_names if EXPERT_RE.match(n[len("mtp."):])]
        if head_experts and all(n in scales for n in head_experts):
            keep.update(head_experts)
    for file in sorted(want):
        with safe_open(file, framework="pt") as f:
            for n in want[file]:
                t = f.get_tensor(n)
                if n in keep:
                    s = scale_of.pop(n).to(device=device, dtype=torch.float32)
                    raw[n] = fp8.FP8Weight(t.to(device), s, fp8.grid_rows(t.shape[-2], quant.block_n, device),
                                           (quant.block_n, quant.block_k))
                else:
                    if n in scale_of:  # on the target device: a large checkpoint dequantizes faster there
                        t = dequant_fp8_block(t.to(device), scale_of.pop(n).to(device), quant.block_n, quant.block_k)
                    if shard is not None and n not in head:
                        t = shard(_canonical(n), t)  # a per-expert tensor by its own (unstacked) name
                    raw[n] = t.to(device=device, dtype=dtype)
                bar.update(1)
    bar.close()
    for canon, n in plan.items():
        tensors[canon] = raw.pop(n)
    for canon, groups in stacked.items():
        rows = [[raw.pop(x) for x in g] for g in groups]
        if isinstance(rows[0][0], fp8.FP8Weight):  # every expert's parts: kept (see `keep`)
            tensors[canon] = fp8.stack_experts(rows)
        else:
            tensors[canon] = torch.stack([torch.cat(r, dim=0) for r in rows])
    for n in mtp_names:
        mtp[n] = raw.pop(n)
    return tensors, mtp


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0,
                   std: float = 0.02, shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                   ) -> dict[str, torch.Tensor]:
    """Random tensors of the model's exact shapes, made directly on `device` (no checkpoint needed).

    Matrices ~ N(0, std); zero-centred norms 0 (scale 1); the gated norm 1; A = exp(A_log) in [1, 16];
    dt_bias 1; conv filters ~ N(0, 1/sqrt(kernel)) so the conv neither vanishes nor explodes.
    `shard(name, tensor)`: applied to each tensor as it is made (load_checkpoint's), so only one
    whole tensor exists at a time; the values are those of the unsharded call.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
            t = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith("A_log"):
            t = (torch.rand(shape, generator=gen, device=device) * 15 + 1).log().to(dtype)
        elif len(shape) == 1:
            t = torch.zeros(shape, dtype=dtype, device=device)
        elif name.endswith("conv1d.weight"):
            t = torch.randn(shape, generator=gen, device=device, dtype=dtype) / math.sqrt(cfg.conv_kernel)
        else:
            t = torch.randn(shape, generator=gen, device=device, dtype=dtype) * std
        out[name] = t if shard is None else shard(name, t)
    return out
