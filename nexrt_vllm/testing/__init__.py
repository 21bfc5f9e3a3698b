"""Tiny checkpoints (random, or trained to continue periodic text) + tokenizer, written with
transformers' own classes.

Used by the tests, the demo and the CPU benchmarks: real `config.json` + safetensors + tokenizer files
that both vLLM and the NexRT engine load through their normal loading code. Needs torch and
transformers (imported lazily, so importing this module is cheap).

Choices that make parity tests meaningful:
- the tokenizer is a Metaspace BPE over ASCII letters (no byte fallback), so any token sequence
  detokenizes to the same text everywhere; `vocab_size` == tokenizer length;
- matrices are re-initialised wider (std 0.06) so greedy decoding does not collapse into one token;
- head dims default to 64 (vLLM's CPU kernels accept 64 or 128, not 32);
- `train="periodic"` gives a checkpoint whose greedy tokens lead by several nats and depend on the
  context (exact token-equality tests across bf16 / fp32 implementations; a wrong state shows);
- `train="agents"` one that answers chat requests with reasoning, a tool call or JSON, with the
  Qwen markup in its tokenizer and a template that renders `tools` (testing/agents.py).
"""
from __future__ import annotations

import json
import math
import os
import random
import string

ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
# ChatML, as the Qwen family uses; vLLM applies it for /v1/chat/completions.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(n_words: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    letters = string.ascii_lowercase
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 8))) for _ in range(600)]
    lines = []
    for _ in range(n_words // 10):
        lines.append(" ".join(rng.choice(words) for _ in range(10)))
    lines.append(string.ascii_letters + " " + string.punctuation + " " + string.digits)
    return lines


def make_tokenizer(path: str, vocab_size: int = 384, agents: bool = False) -> int:
    """Write tokenizer.json + tokenizer_config.json to `path`; return the tokenizer length.

    `agents`: the Qwen markup as added tokens and agents.AGENT_CHAT_TEMPLATE (testing/agents.py),
    the BPE that many tokens smaller (the same tokenizer length)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    alphabet = list(string.ascii_letters + string.digits + string.punctuation) + ["▁"]
    template = CHAT_TEMPLATE
    if agents:
        from .agents import AGENT_CHAT_TEMPLATE, MARKUP
        vocab_size, template = vocab_size - len(MARKUP), AGENT_CHAT_TEMPLATE
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if agents:  # not special: vLLM's reasoning/tool parsers see them in the detokenized text
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "model_max_length": 1 << 20,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return tok.get_vocab_size(with_added_tokens=True)


def tiny_config(arch: str, vocab_size: int, eos_token_id: int, **overrides):
    """A transformers config object of the given family, small enough for CPU tests."""
    import transformers as tf

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    num_layers = overrides.pop("num_hidden_layers", 4)
    interval = overrides.pop("full_attention_interval", 4)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        initializer_range=0.06,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        bos_token_id=None,
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(num_layers)],
    )
    # The family's RoPE: theta 1e7, rotary on the first 25 % of head_dim.
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    if arch == "qwen3_5":
        common.update(intermediate_size=256)
        cls = tf.Qwen3_5TextConfig
    else:
        common.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=64)
        if arch == "qwen3_next":
            common.update(intermediate_size=256, decoder_sparse_step=1, norm_topk_prob=True,
                          mlp_only_layers=[])
            cls = tf.Qwen3NextConfig
        else:
            cls = tf.Qwen3_5MoeTextConfig
    common.update(overrides)
    rope = {**rope, **common.pop("rope_parameters", {})}
    cfg = cls(**common, rope_parameters=rope)
    if arch == "qwen3_5":
        cfg.architectures = ["Qwen3_5ForCausalLM"]
    elif arch == "qwen3_5_moe":
        cfg.architectures = ["Qwen3_5MoeForCausalLM"]
    else:
        cfg.architectures = ["Qwen3NextForCausalLM"]
    return cfg


def _model_class(arch: str):
    import transformers as tf

    return {"qwen3_next": tf.Qwen3NextForCausalLM, "qwen3_5": tf.Qwen3_5ForCausalLM,
            "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM}[arch]


def make_checkpoint(path: str, arch: str = "qwen3_next", dtype: str = "bfloat16",
                    sharded: bool = False, seed: int = 0, init_std: float = 0.06,
                    train: str | None = None, final_norm_fixed: bool = False, mtp: bool = False,
                    **overrides) -> str:
    """Write a tiny checkpoint (config.json, safetensors, tokenizer) to `path`; return it.

    Random weights, or with ``train="periodic"`` trained to copy periodic text (see
    `train_periodic`: greedy decoding is then confident and decided by the context), or with
    ``train="agents"`` to answer chat requests with reasoning, a tool call or JSON (testing/agents.py).
    `overrides` go into the transformers config (e.g. num_hidden_layers=8, full_attention_interval=2,
    num_key_value_heads=1, num_experts=4, num_experts_per_tok=1, tie_word_embeddings=True).
    `final_norm_fixed`: the final norm's weight stays 0 (scale 1), also in training, so the model can be
    rotated into a larger hidden size with its embeddings tied (nexrt_vllm/bench/graft.py).
    `mtp`: also an MTP head (`mtp.*`, vLLM's names; testing/mtp_head.py), trained after the model
    (which it fine-tunes) when ``train="periodic"``, else random.
    """
    import torch

    if train not in (None, "periodic", "agents"):
        raise ValueError(f"unknown train={train!r}; expected None, 'periodic' or 'agents'")

    os.makedirs(path, exist_ok=True)
    vocab = make_tokenizer(path, agents=train == "agents")
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(os.path.join(path, "tokenizer.json")).token_to_id(EOS_TOKEN)
    cfg = tiny_config(arch, vocab, eos, **overrides)
    torch.manual_seed(seed)
    model = _model_class(arch)(cfg)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            # Widen 2-D matrices (projections, experts, embeddings); keep norms, A_log, dt_bias
            # and conv filters at their family-specific init.
            if p.dim() >= 2 and "conv1d" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
            elif "norm" in name and p.dim() == 1:
                # Non-trivial norm weights so a wrong norm convention shows up in parity tests.
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    if final_norm_fixed:
        model.model.norm.weight.data.zero_()
        model.model.norm.weight.requires_grad_(False)
    if train == "periodic":
        train_periodic(model, path, seed=seed)
    elif train == "agents":
        from .agents import train_agents
        train_agents(model, path, seed=seed)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(path, max_shard_size="300KB" if sharded else "10GB")
    if mtp:
        from .mtp_head import add_mtp_head
        add_mtp_head(path, train=train == "periodic", seed=seed, init_std=init_std)
    return path


# --- a trained tiny checkpoint: greedy decoding that is confident and decided by the context ------

# Measured on one core of the 2-core CI box: 350 steps = 133 s, min top-1 margin 5.1 nats on plain
# periodic prompts of 5..2000 tokens and 1.2 nats on chat-template prompts (225 steps = 84 s:
# one wrong copy in 36 held-out prompts, chat margin 0.46 nats, with an earlier chat-sample mix).
TRAIN_STEPS = 350
TRAIN_LR = 3e-3
TRAIN_BATCH = 32
TRAIN_LEN = 64
TRAIN_INIT_STD = 0.02
TRAIN_CHAT = 0.25   # share of samples inside the chat template
PERIODS = (2, 24)


def chat_frame(path: str) -> tuple[list[int], list[int]]:
    """Token ids of CHAT_TEMPLATE around one user message whose text starts with a space:
    (header before the text, footer after it, generation prompt included)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    return (tok.encode("<|im_start|>user\n", add_special_tokens=False).ids,
            tok.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids)


def periodic_sample(rng: random.Random, vocab: int, length: int, frame=None):
    """(ids, loss mask) of one training sequence: a segment of p distinct ordinary tokens repeated
    to ``length``; mask[t] = 1 where ids[t + 1] is decided by the context (after the first
    period). With ``frame`` = (header, footer): header + periodic user text + footer, then the
    reply repeats the text from its start (the chat template around a periodic message)."""
    p = rng.randint(*PERIODS)
    special = set(range(len(SPECIAL_TOKENS)))
    head, foot = frame or ((), ())
    seg = rng.sample([t for t in range(vocab) if t not in special and t not in head and t not in foot], p)
    if not frame:
        ids = [seg[i % p] for i in range(length)]
        return ids, [0] * p + [1] * (length - p - 1) + [0]
    n_text = rng.randint(p + 1, max(p + 1, length - len(head) - len(foot) - 8))
    text = [seg[i % p] for i in range(n_text)]
    ids = list(head) + text + list(foot)
    mask = [0] * len(head) + [0] * p + [1] * (n_text - p - 1) + [0] + [0] * (len(foot) - 1) + [1]
    rest = length - len(ids)
    ids += [seg[i % p] for i in range(rest)]
    mask += [1] * (rest - 1) + [0]
    return ids, mask


def train_periodic(model, path: str, seed: int = 0, steps: int = None, log=None) -> dict:
    """Train `model` (fp32, in place, CPU, deterministic) to continue periodic token sequences.

    Each sample is a segment of 2-24 distinct ordinary tokens repeated to 64 tokens (a quarter
    inside the chat template, the reply repeating the text): the next token is then decided by
    the context alone, so a decode that starts from a wrong state emits other tokens. Trained
    with the embeddings tied (the copy circuit forms several times faster), saved untied.
    Returns {"seconds", "steps", "loss"}."""
    import torch

    steps = steps or TRAIN_STEPS
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order whatever the caller's setting: the same weights
    try:
        return _train(model, path, seed, steps, log)
    finally:
        torch.set_num_threads(threads)


def _train(model, path: str, seed: int, steps: int, log, batches=None, lr: float = TRAIN_LR) -> dict:
    """`batches(rng)` -> [(ids, loss mask)] per step (default: periodic samples); shorter
    sequences are padded, outside the loss."""
    import time

    import torch

    torch.manual_seed(seed)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # small init, residual branches' output projections zero: learns ~2x faster
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * TRAIN_INIT_STD)
                if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")):
                    p.zero_()
    vocab = model.config.vocab_size
    if batches is None:
        frame = chat_frame(path)

        def batches(rng):
            return [periodic_sample(rng, vocab, TRAIN_LEN, frame if rng.random() < TRAIN_CHAT else None)
                    for _ in range(TRAIN_BATCH)]
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    head.weight = emb.weight  # tied while training
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    t0, loss = time.monotonic(), None
    for step in range(steps):
        warm = min(1.0, (step + 1) / 30)
        for g in opt.param_groups:
            g["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        batch = batches(rng)
        width = max(len(b[0]) for b in batch)
        ids = torch.tensor([b[0] + [0] * (width - len(b[0])) for b in batch])
        mask = torch.tensor([b[1] + [0] * (width - len(b[1])) for b in batch], dtype=torch.bool)[:, :-1]
        logits = model(ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask].float(), ids[:, 1:][mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log and (step % 25 == 0 or step == steps - 1):
            log(f"step {step} loss {loss.item():.4f} {time.monotonic() - t0:.1f}s")
    model.eval()
    head.weight = torch.nn.Parameter(emb.weight.detach().clone())  # untied again
    return {"seconds": time.monotonic() - t0, "steps": steps, "loss": loss.item()}


def copy_margins(model, ids: list[int], start: int) -> list[float]:
    """Teacher-forced on `ids`: for each position t >= start, logit(ids[t+1]) - best other logit."""
    import torch

    with torch.no_grad():
        lg = model(torch.tensor([ids])).logits[0, :-1].float()
    tgt = torch.tensor(ids[1:])
    own = lg.gather(1, tgt[:, None])[:, 0]
    lg.scatter_(1, tgt[:, None], float("-inf"))
    return (own - lg.max(1).values)[start:].tolist()


# --- FP8 versions of the tiny checkpoints (Hugging Face fine-grained FP8) --------------------------

# Modules left in bf16: the head and the small router / shared-expert gates (their errors would move
# routing and the gate more than weights). The published checkpoints also keep the GDN in_proj_a / b
# in bf16 (engine.fp8.PUBLISHED_NOT_CONVERT); this default quantizes them, so every GDN projection
# of a test checkpoint is fp8.
FP8_NOT_CONVERT = ("lm_head", "mlp.gate", "mlp.shared_expert_gate")

# make_checkpoint overrides with head counts that TP = 2 and 4 divide: KV heads 2 (replicated at TP = 4),
# 4, 1 (replicated at both); the tensor-parallel tests' checkpoints
TP_SHAPES = {
    "qwen3_next": dict(num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4,
                       linear_num_value_heads=8),
    "qwen3_5": dict(num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=4,
                    tie_word_embeddings=True),
    "qwen3_5_moe": dict(num_attention_heads=4, num_key_value_heads=1, linear_num_key_heads=4,
                        linear_num_value_heads=8, num_hidden_layers=5, full_attention_interval=2),
}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8_block(w, block_n: int, block_k: int):
    """(e4m3 weight, fp32 scale_inv [..., ceil(N/bn), ceil(K/bk)]): scale = block amax / 448
    (engine.fp8.quantize_block, which decode_bench's fp8 runs use too)."""
    from ..engine.fp8 import quantize_block
    return quantize_block(w, block_n, block_k)


def _write_safetensors(path: str, tensors: dict, shards: int) -> None:
    from safetensors.torch import save_file

    names = sorted(tensors)
    if shards <= 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    # Round-robin over sorted names: a weight and its `_scale_inv` land in different shards.
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def make_fp8_checkpoint(src_dir: str, dst_dir: str, block=128, not_convert=FP8_NOT_CONVERT,
                        shards: int = 1, language_model_prefix: bool = False,
                        dequantized_dir: str | None = None) -> str:
    """Quantize `src_dir`'s Linear weights into Hugging Face fine-grained FP8 at `dst_dir`; return it.

    Every 2-D `*.weight` except embeddings and modules matching `not_convert` (transformers' rule)
    becomes float8_e4m3fn plus an fp32 `*.weight_scale_inv` per `block` (int, or (block_n, block_k));
    config.json gains `quantization_config`. Tokenizer and generation files are copied.
    `shards` > 1 writes a sharded checkpoint; `language_model_prefix` renames `model.` to
    `model.language_model.` (as Qwen3.5 VL checkpoints nest the text model).
    `dequantized_dir`: also write the dequantized weights there as an fp32 checkpoint (the oracle).
    """
    import shutil

    import torch
    from safetensors import safe_open

    from ..engine.weights import _checkpoint_files, _not_converted, dequant_fp8_block

    bn, bk = (block, block) if isinstance(block, int) else tuple(block)
    not_convert = tuple(not_convert)
    src: dict = {}
    for name, file in _checkpoint_files(src_dir).items():
        with safe_open(file, framework="pt") as f:
            src[name] = f.get_tensor(name)
    quant, deq = {}, {}
    for name, t in src.items():
        module = name[:-len(".weight")]
        if (name.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in name
                and not _not_converted(module, not_convert)):
            q, s = quantize_fp8_block(t, bn, bk)
            quant[name], quant[name + "_scale_inv"] = q, s
            deq[name] = dequant_fp8_block(q, s, bn, bk)
        else:
            quant[name] = t
            deq[name] = t.float()
    if language_model_prefix:
        quant = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t
                 for n, t in quant.items()}

    with open(os.path.join(src_dir, "config.json")) as f:
        config = json.load(f)
    for out in [dst_dir] + ([dequantized_dir] if dequantized_dir else []):
        os.makedirs(out, exist_ok=True)
        for fname in os.listdir(src_dir):
            if fname != "config.json" and not fname.startswith("model") and not fname.endswith(".safetensors"):
                shutil.copy(os.path.join(src_dir, fname), os.path.join(out, fname))
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [bn, bk], "modules_to_not_convert": list(not_convert)}}, f, indent=2)
    _write_safetensors(dst_dir, quant, shards)
    if dequantized_dir:
        with open(os.path.join(dequantized_dir, "config.json"), "w") as f:
            json.dump({**config, "dtype": "float32"}, f, indent=2)
        _write_safetensors(dequantized_dir, deq, 1)
    return dst_dir
