"""An MTP head for the tiny checkpoints, random or trained (transformers has no MTP module).

Built from transformers' own decoder-layer and RMSNorm classes of the family, wired as vLLM's
qwen3_next_mtp.py / qwen3_5_mtp.py do: fc over [norm(embed(x_{t+1})) ; norm(H_t)], one full-attention
decoder layer (MoE in MoE models), a final norm, the model's lm_head. Saved next to the model's
tensors under vLLM's names (`mtp.fc.weight`, `mtp.layers.0...`, experts per expert), with
`mtp_num_hidden_layers: 1` in config.json, so the engine's loader and vLLM both read them.

`train=True` trains the head on the periodic recipe of `testing.train_periodic`: from the model's
final-normed hidden state at t and the token at t+1 it learns the token at t+2 where the context
decides it (plus the chained step: its own output as the hidden state, one position on). The model
is fine-tuned with it, its own loss kept: a frozen model's hidden state carries little beyond its
next token, and a one-layer head cannot find the token after the previous occurrence from that.
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import time

MTP_TRAIN_STEPS = 150
MTP_TRAIN_LR = 3e-3
MTP_MODEL_LR = 1e-3  # the model is fine-tuned with the head (from its trained weights)
# the chained loss: the head's own output fed back as the hidden state one position on (what the
# drafter's chained steps do at inference)
MTP_CHAIN_WEIGHT = 0.5


def _head_class():
    import torch
    from torch import nn

    class MTPHead(nn.Module):
        def __init__(self, model):
            super().__init__()
            cfg = copy.deepcopy(model.config)
            cfg.layer_types, cfg.num_hidden_layers = ["full_attention"], 1
            layer_cls = type(next(m for m in model.model.layers if hasattr(m, "self_attn")))
            norm_cls = type(model.model.norm)
            H, eps = cfg.hidden_size, cfg.rms_norm_eps
            self.layer_config = cfg
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.pre_fc_norm_embedding = norm_cls(H, eps=eps)
            self.pre_fc_norm_hidden = norm_cls(H, eps=eps)
            self.layers = nn.ModuleList([layer_cls(cfg, 0)])
            self.norm = norm_cls(H, eps=eps)

        def forward(self, model, tokens, hidden, positions):
            """tokens [B, L] (the token after each position), hidden [B, L, H] -> (g, logits)."""
            from transformers.masking_utils import create_causal_mask

            e = self.pre_fc_norm_embedding(model.model.embed_tokens(tokens))
            x = self.fc(torch.cat((e, self.pre_fc_norm_hidden(hidden)), dim=-1))
            pe = model.model.rotary_emb(x, positions)
            mask = create_causal_mask(config=self.layer_config, inputs_embeds=x, attention_mask=None,
                                      past_key_values=None, position_ids=positions)
            x = self.layers[0](x, position_embeddings=pe, attention_mask=mask, position_ids=positions)
            g = self.norm(x)
            return g, model.lm_head(g)

    return MTPHead


def mtp_tensors(head, dtype) -> dict:
    """The head's parameters under the checkpoint's names (`mtp.` + ..., experts per expert)."""
    out = {}
    for name, t in head.state_dict().items():
        t = t.detach().to(dtype).contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows then up rows
            p, inter = name[:-len("gate_up_proj")], t.shape[1] // 2
            for j in range(t.shape[0]):
                out[f"mtp.{p}{j}.gate_proj.weight"] = t[j, :inter].clone()
                out[f"mtp.{p}{j}.up_proj.weight"] = t[j, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            p = name[:-len("down_proj")]
            for j in range(t.shape[0]):
                out[f"mtp.{p}{j}.down_proj.weight"] = t[j].clone()
        else:
            out["mtp." + name] = t
    return out


def _write(path: str, tensors: dict) -> None:
    """Add `tensors` to the checkpoint at `path` (single file rewritten, or a new shard + index)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            idx = json.load(f)
        fname = "model-mtp.safetensors"
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        idx["weight_map"].update({n: fname for n in tensors})
        with open(index, "w") as f:
            json.dump(idx, f, indent=1)
    else:
        single = os.path.join(path, "model.safetensors")
        with safe_open(single, framework="pt") as f:
            have = {n: f.get_tensor(n) for n in f.keys()}
        save_file({**have, **tensors}, single, metadata={"format": "pt"})
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["mtp_num_hidden_layers"] = 1
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def add_mtp_head(path: str, train: bool = False, seed: int = 0, init_std: float = 0.06, steps: int | None = None,
                 log=None) -> dict:
    """Give the checkpoint at `path` an MTP head (in place): random (std `init_std`, norms perturbed, as
    `make_checkpoint` initialises the model), or trained together with a fine-tune of the model
    (which is rewritten too; start from a `train="periodic"` checkpoint). Returns {"seconds",
    "steps", "loss"} (0 steps when not trained)."""
    import torch
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        dtype = getattr(torch, json.load(f).get("dtype", "bfloat16"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order: the same head whatever the caller's setting
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.eval()
        torch.manual_seed(seed + 7)
        head = _head_class()(model)
        gen = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * (0.02 if train else init_std))
                    if train and name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                        p.zero_()
                elif "norm" in name and p.dim() == 1 and not train:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        stats = {"seconds": 0.0, "steps": 0, "loss": float("nan")}
        if train:
            stats = _train(model, head, path, seed, steps or MTP_TRAIN_STEPS, log)
            model = model.to(dtype)
            model.config.dtype = str(dtype).removeprefix("torch.")
            for f in os.listdir(path):  # the fine-tuned model replaces every old tensor file
                if f.endswith(".safetensors") or f == "model.safetensors.index.json":
                    os.remove(os.path.join(path, f))
            model.save_pretrained(path, max_shard_size="10GB")
        _write(path, mtp_tensors(head, dtype))
        return stats
    finally:
        torch.set_num_threads(threads)


def _train(model, head, path: str, seed: int, steps: int, log) -> dict:
    """Fine-tune model + head together: the model's own loss keeps it continuing the period; the
    head's loss also reaches the model through H_t, which must carry what the head needs (a
    frozen model's final hidden state holds little beyond its own next token)."""
    import torch
    import torch.nn.functional as F

    from . import TRAIN_BATCH, TRAIN_CHAT, TRAIN_LEN, chat_frame, periodic_sample

    rng = random.Random(seed + 11)
    vocab, frame = model.config.vocab_size, chat_frame(path)
    model.train()
    head.train()
    opt = torch.optim.AdamW([{"params": list(model.parameters()), "lr": MTP_MODEL_LR, "base": MTP_MODEL_LR},
                             {"params": list(head.parameters()), "lr": MTP_TRAIN_LR, "base": MTP_TRAIN_LR}],
                            betas=(0.9, 0.98), weight_decay=0.0)
    t0, loss = time.monotonic(), None
    L = TRAIN_LEN
    pos = torch.arange(L - 1)[None]
    for step in range(steps):
        warm = min(1.0, (step + 1) / 20)
        for g in opt.param_groups:
            g["lr"] = g["base"] * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        batch = [periodic_sample(rng, vocab, L, frame if rng.random() < TRAIN_CHAT else None)
                 for _ in range(TRAIN_BATCH)]
        ids = torch.tensor([b[0] for b in batch])
        mask = torch.tensor([b[1] for b in batch], dtype=torch.bool)  # mask[t]: ids[t+1] decided
        hidden = model.model(ids).last_hidden_state  # final-normed, as vLLM hands it to the head
        m0 = mask[:, :-1]
        main = F.cross_entropy(model.lm_head(hidden[:, :-1])[m0].float(), ids[:, 1:][m0])
        # position t: hidden H_t and token ids[t+1] -> ids[t+2]
        g, logits = head(model, ids[:, 1:], hidden[:, :-1], pos)
        m1 = mask[:, 1:-1]
        mtp = F.cross_entropy(logits[:, :-1][m1].float(), ids[:, 2:][m1])
        loss = main + mtp
        if MTP_CHAIN_WEIGHT:
            # chained: the head's own output at t as the hidden state with token ids[t+2] -> ids[t+3]
            _, logits2 = head(model, ids[:, 2:], g[:, :-1], pos[:, 1:])
            m2 = mask[:, 2:-1]
            loss = loss + MTP_CHAIN_WEIGHT * F.cross_entropy(logits2[:, :-1][m2].float(), ids[:, 3:][m2])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(head.parameters()), 1.0)
        opt.step()
        if log and (step % 25 == 0 or step == steps - 1):
            log(f"mtp step {step} loss {loss.item():.4f} (model {main.item():.4f}, head {mtp.item():.4f}) "
                f"{time.monotonic() - t0:.1f}s")
    model.eval()
    head.eval()
    return {"seconds": time.monotonic() - t0, "steps": steps, "loss": loss.item()}
