"""A model directory at a real shape with no weights (the benchmarks' `--load-format dummy` runs): the
HF config.json vLLM and the node read, the Qwen3.5 tokenizer and a ChatML template."""
from __future__ import annotations

import json
import os
import shutil

from nexrt_vllm.bench.shapes import SHAPES

ARCH = {"2b": "qwen3_5", "35b": "qwen3_5_moe", "tiny": "qwen3_next"}
# "tiny": a tiny Qwen3-Next with the real vocabulary, to run a GPU benchmark end to end on a CPU
TINY = {"vocab_size": 248320}
EOS = "<|im_end|>"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_model_dir(path: str, shape: str, tokenizer_dir: str, layers: int | None, mtp: bool = False) -> dict:
    """config.json of the real shape (HF format, read by vLLM and the node) + the tokenizer files."""
    from tokenizers import Tokenizer

    from nexrt_vllm.testing import tiny_config

    os.makedirs(path, exist_ok=True)
    shutil.copy(os.path.join(tokenizer_dir, "tokenizer.json"), path)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    if eos is None:
        raise SystemExit(f"{tokenizer_dir}/tokenizer.json has no {EOS} token (not a Qwen3.5 tokenizer)")
    spec = SHAPES.get(shape, TINY)
    over = {k: v for k, v in spec.items() if k not in ("vocab_size", "architectures", "dtype")}
    if layers:
        over["num_hidden_layers"] = layers
    if mtp:  # the published Qwen3.5 checkpoints carry one MTP layer
        over["mtp_num_hidden_layers"] = 1
    cfg = tiny_config(ARCH[shape], spec["vocab_size"], eos, **over)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": "<|endoftext|>",
                   "bos_token": None, "model_max_length": 262144, "chat_template": CHATML}, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f)
    return {"layers": cfg.num_hidden_layers, "eos": eos, "tokenizer_vocab": tok.get_vocab_size()}
