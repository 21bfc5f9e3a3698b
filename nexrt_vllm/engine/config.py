"""ModelConfig: the engine's view of a Hugging Face config.json (Qwen3.5 family and Qwen3-Next).

Parsing is pure Python (no torch, no transformers), so the decode node and tools can read a model's
shapes cheaply.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from nexrt_vllm.engine.dtypes import MODEL_DTYPES
from nexrt_vllm.engine.errors import ConfigError

# (architecture name, its model_type, family, whether the text config is nested under "text_config")
_CHECKPOINT_KINDS = (
    ("Qwen3NextForCausalLM", "qwen3_next", "qwen3_next", False),
    ("Qwen3_5ForCausalLM", "qwen3_5_text", "qwen3_5", False),
    ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", "qwen3_5_moe", False),
    ("Qwen3_5ForConditionalGeneration", "qwen3_5", "qwen3_5", True),
    ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", "qwen3_5_moe", True),
)
ARCHITECTURES = {arch: (family, nested) for arch, _, family, nested in _CHECKPOINT_KINDS}
# by model_type, for configs without an "architectures" list
MODEL_TYPES = {mtype: (family, nested) for _, mtype, family, nested in _CHECKPOINT_KINDS}
FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class FP8BlockQuant:
    """Hugging Face fine-grained FP8 (`quant_method: fp8`): e4m3 weights, one fp32 `*_scale_inv` per
    block_n x block_k block; activations unquantized (dynamic scheme) so the weights alone carry it."""
    block_n: int
    block_k: int
    modules_to_not_convert: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [self.block_n, self.block_k],
                "modules_to_not_convert": list(self.modules_to_not_convert)}


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "qwen3_next" | "qwen3_5" | "qwen3_5_moe"
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    # gated full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # gated delta net
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    # feed-forward: dense size (0 when no layer is dense) and MoE shapes (num_experts 0 = none)
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"  # the checkpoint's dtype; the engine computes in it unless told otherwise
    max_position_embeddings: int = 32768
    mtp_num_layers: int = 0
    quantization: FP8BlockQuant | None = None  # None: every tensor is stored in a float dtype
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: q, k, v concatenated in that order."""
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    def is_moe_layer(self, i: int) -> bool:
        # Qwen3-Next's rule (modeling_qwen3_next.py); Qwen3.5-MoE has every layer sparse, which
        # the same rule gives with decoder_sparse_step=1 and no mlp_only_layers.
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    # ---- loading --------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        """Read `path/config.json` (and `generation_config.json` for extra EOS ids, if present)."""
        cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        try:
            with open(cfg_path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {cfg_path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from None
        eos_extra: list[int] = []
        gen_path = os.path.join(os.path.dirname(cfg_path), "generation_config.json")
        if os.path.exists(gen_path):
            try:
                with open(gen_path) as f:
                    eos_extra = _int_list(json.load(f).get("eos_token_id"), "generation_config eos_token_id")
            except json.JSONDecodeError as e:
                raise ConfigError(f"{gen_path} is not valid JSON: {e}") from None
        return cls.from_dict(raw, extra_eos=eos_extra)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], extra_eos: list[int] | tuple[int, ...] = ()) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is not None:
            family, nested = ARCHITECTURES[arch]
        elif archs:
            raise ConfigError(f"unsupported architecture {archs[0]!r}; supported: {sorted(ARCHITECTURES)}")
        elif raw.get("model_type") in MODEL_TYPES:
            family, nested = MODEL_TYPES[raw["model_type"]]
            arch = raw["model_type"]
        else:
            raise ConfigError(f"unsupported model_type {raw.get('model_type')!r} and no known "
                              f"'architectures'; supported: {sorted(ARCHITECTURES)}")
        text = raw
        if nested:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{arch} config has no 'text_config' object")
        return _parse(text, family, arch, top=raw, extra_eos=extra_eos)

    def to_dict(self) -> dict[str, Any]:
        """A config.json (text model) that `from_dict` reads back into an equal ModelConfig."""
        d: dict[str, Any] = {
            "architectures": [{"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
                               "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[self.family]],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "layer_types": list(self.layer_types),
            "rms_norm_eps": self.rms_norm_eps, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.conv_kernel, "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": list(self.eos_token_ids), "dtype": self.dtype,
            "max_position_embeddings": self.max_position_embeddings,
        }
        if self.quantization is not None:
            d["quantization_config"] = self.quantization.to_dict()
        if self.mtp_num_layers:
            d["mtp_num_hidden_layers"] = self.mtp_num_layers
        if self.family != "qwen3_5_moe":
            d["intermediate_size"] = self.intermediate_size
        if self.family != "qwen3_5":
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size,
                     shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        if self.family == "qwen3_next":
            d.update(norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers))
        return d


def _int_list(v: Any, what: str) -> list[int]:
    if v is None:
        return []
    if isinstance(v, bool) or not isinstance(v, (int, list)):
        raise ConfigError(f"{what} must be an int or a list of ints, got {v!r}")
    vals = v if isinstance(v, list) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in vals):
        raise ConfigError(f"{what} must hold non-negative ints, got {v!r}")
    return vals


def _quantization(q: Any, arch: str) -> FP8BlockQuant | None:
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"{arch} config field 'quantization_config' must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"{arch}: unsupported quantization_config.quant_method {method!r} "
                          f"(only 'fp8', fine-grained block-scaled)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{arch}: unsupported quantization_config.fmt {fmt!r} (only 'e4m3')")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"{arch}: unsupported quantization_config.activation_scheme {scheme!r} "
                          f"(only 'dynamic'; static input scales are not read)")
    block = q.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        # Per-tensor FP8 (no weight_block_size) keeps one scale per weight: not this format.
        raise ConfigError(f"{arch}: quantization_config.weight_block_size must be two positive ints "
                          f"[block_n, block_k], got {block!r}")
    skip = q.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise ConfigError(f"{arch}: quantization_config.modules_to_not_convert must be a list of "
                          f"module names, got {skip!r}")
    return FP8BlockQuant(block[0], block[1], tuple(skip))


def _parse(c: dict[str, Any], family: str, arch: str, top: dict[str, Any],
           extra_eos: list[int] | tuple[int, ...]) -> ModelConfig:
    def req(name: str, typ: type = int) -> Any:
        if name not in c or c[name] is None:
            raise ConfigError(f"{arch} config is missing required field {name!r}")
        v = c[name]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) if typ is float else \
            isinstance(v, typ) and not (typ is int and isinstance(v, bool))
        if not ok or (typ in (int, float) and v <= 0):
            raise ConfigError(f"{arch} config field {name!r} must be a positive {typ.__name__}, got {v!r}")
        return v

    def opt(name: str, default: Any) -> Any:
        v = c.get(name)
        return default if v is None else v

    num_layers = req("num_hidden_layers")
    layer_types = c.get("layer_types")
    if layer_types is None:
        interval = opt("full_attention_interval", 4)
        if not isinstance(interval, int) or interval <= 0:
            raise ConfigError(f"{arch} config field 'full_attention_interval' must be a positive int")
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != num_layers
            or any(t not in LAYER_TYPES for t in layer_types)):
        raise ConfigError(f"{arch} config field 'layer_types' must list {num_layers} entries from "
                          f"{LAYER_TYPES}, got {layer_types!r}")

    if opt("hidden_act", "silu") != "silu":
        raise ConfigError(f"{arch}: unsupported hidden_act {c['hidden_act']!r} (only 'silu')")
    if opt("attention_bias", False):
        raise ConfigError(f"{arch}: attention_bias=true is not supported")

    # RoPE: transformers>=5 writes rope_parameters; older configs keep rope_theta etc. top-level.
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{arch} config field 'rope_parameters' must be an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{arch}: unsupported rope_type {rope_type!r} (only 'default')")
    rope_theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)))
    if not 0.0 < partial <= 1.0:
        raise ConfigError(f"{arch}: partial_rotary_factor must be in (0, 1], got {partial}")

    hidden = req("hidden_size")
    num_heads = req("num_attention_heads")
    num_kv = req("num_key_value_heads")
    head_dim = opt("head_dim", hidden // num_heads)
    if num_heads % num_kv:
        raise ConfigError(f"{arch}: num_attention_heads {num_heads} is not a multiple of "
                          f"num_key_value_heads {num_kv}")
    nk, nv = req("linear_num_key_heads"), req("linear_num_value_heads")
    if nv % nk:
        raise ConfigError(f"{arch}: linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")

    kw: dict[str, Any] = {}
    if family == "qwen3_5":
        kw["intermediate_size"] = req("intermediate_size")
    else:
        kw.update(num_experts=req("num_experts"), num_experts_per_tok=req("num_experts_per_tok"),
                  moe_intermediate_size=req("moe_intermediate_size"),
                  shared_expert_intermediate_size=req("shared_expert_intermediate_size"))
        if kw["num_experts_per_tok"] > kw["num_experts"]:
            raise ConfigError(f"{arch}: num_experts_per_tok {kw['num_experts_per_tok']} > "
                              f"num_experts {kw['num_experts']}")
    if family == "qwen3_next":
        step, mlp_only = opt("decoder_sparse_step", 1), opt("mlp_only_layers", [])
        if not isinstance(step, int) or step <= 0 or not isinstance(mlp_only, list):
            raise ConfigError(f"{arch}: decoder_sparse_step must be a positive int and mlp_only_layers a list")
        kw.update(norm_topk_prob=bool(opt("norm_topk_prob", True)), decoder_sparse_step=step,
                  mlp_only_layers=tuple(mlp_only))
        if any(i in mlp_only or (i + 1) % step for i in range(num_layers)):
            kw["intermediate_size"] = req("intermediate_size")  # some layer is dense

    dtype = c.get("dtype") or c.get("torch_dtype") or top.get("dtype") or top.get("torch_dtype") or "bfloat16"
    if dtype not in MODEL_DTYPES:
        raise ConfigError(f"{arch}: unsupported dtype {dtype!r}; expected one of {MODEL_DTYPES}")
    tie = top.get("tie_word_embeddings", c.get("tie_word_embeddings", False))
    eos = _int_list(c.get("eos_token_id", top.get("eos_token_id")), "eos_token_id")
    eos += [e for e in extra_eos if e not in eos]

    return ModelConfig(
        family=family, architecture=arch, vocab_size=req("vocab_size"), hidden_size=hidden,
        num_layers=num_layers, layer_types=tuple(layer_types), rms_norm_eps=float(opt("rms_norm_eps", 1e-6)),
        num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim, rope_theta=rope_theta,
        partial_rotary_factor=partial, linear_num_key_heads=nk, linear_num_value_heads=nv,
        linear_key_head_dim=req("linear_key_head_dim"), linear_value_head_dim=req("linear_value_head_dim"),
        conv_kernel=opt("linear_conv_kernel_dim", 4), tie_word_embeddings=bool(tie),
        eos_token_ids=tuple(eos), dtype=dtype, max_position_embeddings=opt("max_position_embeddings", 32768),
        mtp_num_layers=opt("mtp_num_hidden_layers", 0),
        quantization=_quantization(top.get("quantization_config", c.get("quantization_config")), arch),
        raw=dict(top), **kw)
