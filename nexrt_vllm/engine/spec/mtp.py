"""The checkpoint's multi-token-prediction head (`mtp.*`) as a drafter for speculative decoding.

Math and weight names are vLLM's (model_executor/models/qwen3_next_mtp.py, qwen3_5_mtp.py): for a
position i with the target's final-normed hidden state H_i and the token x_{i+1} after it,

    u = fc([pre_fc_norm_embedding(embed(x_{i+1})) ; pre_fc_norm_hidden(H_i)])      (embedding first)
    u = decoder layer (full attention at rope position i, K/V row i of the head's own cache;
        MoE in MoE models, by the model's rule for layer index 0)
    g = norm(u);  logits = lm_head(g)            (the target's lm_head; predicts x_{i+2})

and a chained draft step feeds g back as the hidden state with the drafted token, one position on,
as vLLM's proposer does. All norms are the family's zero-centred RMSNorm.

Checkpoint tensors: `mtp.fc.weight` [H, 2H], `mtp.pre_fc_norm_embedding.weight`,
`mtp.pre_fc_norm_hidden.weight`, `mtp.norm.weight` [H], `mtp.layers.0.*` with a decoder layer's
Hugging Face names (experts per expert or stacked, as for the model's layers), optionally
`mtp.embed_tokens.weight` (else the model's embedding is shared).

Draft weights (`DRAFT_WEIGHTS`): "checkpoint" drafts with the head as stored and the target's lm_head;
"fp8" quantizes, at load, the head's projections the published FP8 releases quantize (attention, MLP or
experts; 128 x 128 blocks, as `fp8.quantize_tensors`) and a copy of the lm_head for the drafter alone, so a
single-row draft reads about half the bytes. The head's passes over several rows (the prompt, the verified
rows of a round up to their attention, the batched round's slots) keep reading the head as stored
(`MTPWeights.stored`): the GPU's fp8 M-row GEMVs stream slower than its bf16 ones, so there fp8 would cost
time (H100, 2B: the batched round at 8 slots 3.29 -> 3.54 ms). Of a round's verified rows only the accepted
one goes on past the attention (the others' K/V rows are all later drafts read), through the drafter's layer.
Exactness does not depend on the drafts (the target verifies every token); only acceptance can move. The
head of an FP8 checkpoint kept in fp8 is used as it is.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nexrt_vllm.engine.config import ModelConfig
from nexrt_vllm.engine.errors import ConfigError, WeightsError
from nexrt_vllm.engine.fp8 import PUBLISHED_NOT_CONVERT, FP8Weight, linear, quantize_tensors, quantize_weight, \
    stack_experts
from nexrt_vllm.engine.model import (LayerWeights, MoEWeights, attention_decode, attn_qkv, layer_weights, mlp,
                                     moe_decode, rms_norm, rope_tables)

PREFIX = "mtp."
DRAFT_WEIGHTS = ("checkpoint", "fp8")
FP8_BLOCK = (128, 128)  # the published Qwen3.5 / Qwen3-Next FP8 releases' blocks
_EXPERT_RE = re.compile(r"^layers\.0\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def mtp_layer_count(tensors: dict[str, torch.Tensor]) -> int:
    return len({m[1] for n in tensors if (m := re.match(r"^mtp\.layers\.(\d+)\.", n))})


def expected_mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical names (without `mtp.`) and shapes of the head, experts stacked."""
    from nexrt_vllm.engine.weights import expected_shapes

    H = cfg.hidden_size
    one = ModelConfig(**{**cfg.__dict__, "num_layers": 1, "layer_types": ("full_attention",)})
    shapes = {n: s for n, s in expected_shapes(one).items() if n.startswith("layers.0.")}
    shapes.update({"fc.weight": (H, 2 * H), "pre_fc_norm_embedding.weight": (H,),
                   "pre_fc_norm_hidden.weight": (H,), "norm.weight": (H,)})
    return shapes


@dataclass
class MTPWeights:
    embed: torch.Tensor
    fc: torch.Tensor  # [H, 2H]: columns [embedding | hidden]
    pre_fc_norm_embedding: torch.Tensor
    pre_fc_norm_hidden: torch.Tensor
    norm: torch.Tensor
    layer: LayerWeights
    lm_head: object  # the drafter's lm_head: the target's (the same tensor), or its fp8 copy (draft weights "fp8")
    stored: "MTPWeights | None" = None  # draft weights "fp8": the head as stored, which multi-row passes read

    @property
    def rows(self) -> "MTPWeights":
        """The head the passes over several rows read: as stored."""
        return self.stored if self.stored is not None else self


def random_mtp_tensors(cfg: ModelConfig, dtype: torch.dtype, device, seed: int = 5) -> dict[str, torch.Tensor]:
    """A random head of the config's shape, as the loader returns `mtp.*` tensors (matrices N(0, 0.02),
    norms N(0, 0.1)): what `--load-format dummy` gives a checkpoint whose config declares an MTP layer."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for n, shape in expected_mtp_shapes(cfg).items():
        std = 0.02 if len(shape) > 1 else 0.1
        out[PREFIX + n] = (torch.randn(shape, generator=g) * std).to(dtype).to(device)
    return out


def mtp_weights(cfg: ModelConfig, raw: dict[str, torch.Tensor], embed: torch.Tensor, lm_head,
                draft_weights: str = "checkpoint") -> MTPWeights:
    """Build the head from the loader's `mtp.*` tensors (checked here: they are loaded unvalidated), drafting
    through `lm_head` (the target's), in the format `draft_weights` names (DRAFT_WEIGHTS). ConfigError if there
    is no head or the format is unknown; WeightsError listing every missing / misshaped tensor."""
    if draft_weights not in DRAFT_WEIGHTS:
        raise ConfigError(f"draft_weights must be one of {DRAFT_WEIGHTS}, got {draft_weights!r}")
    if not raw:
        raise ConfigError("the checkpoint has no MTP head (no mtp.* tensors): speculative decoding "
                          "with --speculative mtp needs one")
    n_layers = mtp_layer_count(raw)
    if n_layers != 1:
        raise ConfigError(f"the checkpoint's MTP head has {n_layers} layers; only a single-layer head "
                          f"is supported (as in every Qwen3.5 / Qwen3-Next checkpoint)")
    t = {n[len(PREFIX):]: v for n, v in raw.items()}
    want = expected_mtp_shapes(cfg)
    moe = cfg.is_moe_layer(0)
    experts: dict[str, dict[int, torch.Tensor]] = {"gate": {}, "up": {}, "down": {}}
    problems = []
    for n in list(t):
        m = _EXPERT_RE.match(n)
        if m and moe:
            experts[m[2]][int(m[1])] = t.pop(n)
    if any(experts.values()):
        E = cfg.num_experts
        if any(sorted(d) != list(range(E)) for d in experts.values()):
            problems.append(f"per-expert tensors of layers.0.mlp.experts must cover experts 0..{E - 1} for "
                            f"gate, up and down, got {[sorted(d) for d in experts.values()]}")
        else:
            if isinstance(experts["gate"][0], FP8Weight):  # kept fp8 (the loader keeps all or none)
                t["layers.0.mlp.experts.gate_up_proj"] = stack_experts(
                    [[experts["gate"][j], experts["up"][j]] for j in range(E)])
                t["layers.0.mlp.experts.down_proj"] = stack_experts([[experts["down"][j]] for j in range(E)])
            else:
                t["layers.0.mlp.experts.gate_up_proj"] = torch.stack(
                    [torch.cat((experts["gate"][j], experts["up"][j])) for j in range(E)])
                t["layers.0.mlp.experts.down_proj"] = torch.stack([experts["down"][j] for j in range(E)])
    embed_shape = (cfg.vocab_size, cfg.hidden_size)
    for n, shape in want.items():
        if n not in t:
            problems.append(f"missing {PREFIX}{n}")
        elif tuple(t[n].shape) != shape:
            problems.append(f"{PREFIX}{n}: shape {tuple(t[n].shape)}, expected {shape}")
    extra = sorted(set(t) - set(want) - {"embed_tokens.weight"})
    if extra:
        problems.append(f"unexpected: {[PREFIX + n for n in extra]}")
    if "embed_tokens.weight" in t and tuple(t["embed_tokens.weight"].shape) != embed_shape:
        problems.append(f"{PREFIX}embed_tokens.weight: shape {tuple(t['embed_tokens.weight'].shape)}, "
                        f"expected {embed_shape}")
    if problems:
        raise WeightsError(f"the checkpoint's MTP head does not match the {cfg.architecture} config: "
                           + "; ".join(problems))
    head = MTPWeights(embed=t.get("embed_tokens.weight", embed), fc=t["fc.weight"],
                      pre_fc_norm_embedding=t["pre_fc_norm_embedding.weight"],
                      pre_fc_norm_hidden=t["pre_fc_norm_hidden.weight"], norm=t["norm.weight"],
                      layer=layer_weights(cfg, t, "layers.0.", "full_attention", moe), lm_head=lm_head)
    if draft_weights == "checkpoint":
        return head
    quantized = {**t, **_quantized_layer(t, cfg)}
    return dataclasses.replace(
        head, layer=layer_weights(cfg, quantized, "layers.0.", "full_attention", moe),
        lm_head=lm_head if isinstance(lm_head, FP8Weight) else quantize_weight(lm_head, FP8_BLOCK), stored=head)


def _quantized_layer(t: dict, cfg: ModelConfig) -> dict:
    """The head layer's bf16 projections that a published FP8 release stores in e4m3, quantized (FP8_BLOCK; the
    router, the shared-expert gate and the norms stay); projections already FP8Weight are left as they are."""
    bf16 = {n: v for n, v in t.items() if n.startswith("layers.0.") and isinstance(v, torch.Tensor)}
    return {n: v for n, v in quantize_tensors(bf16, cfg, FP8_BLOCK, PUBLISHED_NOT_CONVERT).items()
            if isinstance(v, FP8Weight)}


class Drafter:
    """The MTP head with its own K/V cache, batch 1.

    Rows of the cache are positions (row i: the head's input at position i). `start` (int64 [1],
    device) is the first valid row: 0 when the head saw the whole prompt, else where the node began
    decoding (rows before it were never written and are masked). The cache has `extra` rows past
    max_seq_len for the chained steps of the last rounds. `over` (k, v, start): tensors of those
    shapes to use instead of its own (a slot of the batched round's head caches, gpu/batch_round.py)."""

    def __init__(self, cfg: ModelConfig, w: MTPWeights, max_seq_len: int, extra: int, over=None):
        self.config, self.w = cfg, w
        dtype, device = w.fc.dtype, w.fc.device
        rows = max_seq_len + extra
        shape = (cfg.num_kv_heads, rows, cfg.head_dim)
        if over is None:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros_like(self.k)
            self.start = torch.zeros(1, dtype=torch.long, device=device)
        else:
            self.k, self.v, self.start = over
            if tuple(self.k.shape) != shape or tuple(self.v.shape) != shape or tuple(self.start.shape) != (1,):
                raise ValueError(f"Drafter over: k / v {shape} and start (1,), got {tuple(self.k.shape)}, "
                                 f"{tuple(self.v.shape)}, {tuple(self.start.shape)}")
        self.rope_cos, self.rope_sin = rope_tables(cfg, rows, dtype, device)
        self.kv_index = torch.arange(rows, device=device)

    def _input(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        eps, w = self.config.rms_norm_eps, self.w
        e = rms_norm(F.embedding(tokens, w.embed), w.pre_fc_norm_embedding, eps)
        return F.linear(torch.cat((e, rms_norm(hidden, w.pre_fc_norm_hidden, eps)), dim=-1), w.fc)

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, row=None):
        """Rows at `positions` (int64 [T], device, consecutive): hidden [T, H], tokens [T] (the token
        after each row's position). Writes their K/V rows; each attends causally to the valid rows
        up to its own. Returns (g [T, H] post-norm, fp32 logits [T, vocab]). No host syncs. A single row reads
        the drafter's layer, several rows the layer as stored (MTPWeights.rows); the logits the drafter's lm_head.
        `row` (int64 [1], device): of several rows only that one goes on after the attention (the K/V rows are all
        a round needs of the others): its MLP reads the drafter's layer, and g, logits are [1, ...]."""
        cfg, eps = self.config, self.config.rms_norm_eps
        layer = self.w.layer if positions.shape[0] == 1 else self.w.rows.layer
        x = self._input(hidden, tokens)
        cos, sin = self.rope_cos.index_select(0, positions), self.rope_sin.index_select(0, positions)
        pos = positions.unsqueeze(1)
        visible = (self.kv_index.unsqueeze(0) <= pos) & (self.kv_index.unsqueeze(0) >= self.start)
        x = x + attention_decode(layer.mixer, cfg, rms_norm(x, layer.input_norm, eps), cos, sin, self.k, self.v,
                                 positions, visible)
        if row is not None:
            x, layer = x.index_select(0, row), self.w.layer
        y = rms_norm(x, layer.post_norm, eps)
        if isinstance(layer.ffn, MoEWeights):  # per row, as decode picks experts (static shapes)
            y = torch.cat([moe_decode(layer.ffn, cfg, y[j:j + 1]) for j in range(y.shape[0])])
        else:
            y = mlp(layer.ffn, y)
        g = rms_norm(x + y, self.w.norm, eps)
        return g, linear(g, self.w.lm_head).float()

    @torch.no_grad()
    def prefill(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """Rows 0..T-1 from the prompt (hidden [T, H] of positions 0..T-1, tokens [T] = prompt tokens
        1..T): the full MTP context, as vLLM's proposer builds it during prefill. Only their K/V
        rows are needed (no later step reads the rows' outputs). start = 0. Reads the layer as stored."""
        cfg, eps, layer = self.config, self.config.rms_norm_eps, self.w.rows.layer
        self.start.zero_()
        T = tokens.shape[0]
        if T == 0:
            return
        x = rms_norm(self._input(hidden, tokens), layer.input_norm, eps)
        _, k, v, _ = attn_qkv(layer.mixer, cfg, x, self.rope_cos[:T], self.rope_sin[:T])
        self.k[:, :T].copy_(k)
        self.v[:, :T].copy_(v)
