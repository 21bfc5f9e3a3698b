"""The draft vocabulary of the graph path's MTP round: the token ids the head's lm_head reads.

`draft_vocab` (Engine.enable_speculative, gpu.spec_round.SpecDecoder) is None (every id), an int N
(ids 0..N-1: the first lm_head rows, no copy) or a token map: N distinct ids in [0, vocab), e.g.
the N most frequent ids of text like the traffic (node/draft_token_map.py builds one). With a map
the round keeps the N lm_head rows gathered once into a contiguous copy and maps the argmax index
back to the token id. Output is exact whatever the vocabulary (the verify emits the target's own
tokens); only acceptance depends on how often the head's choice lies inside it.
"""
from __future__ import annotations

import torch

from nexrt_vllm.engine.errors import ConfigError

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def check_draft_vocab(draft_vocab, vocab_size: int) -> int | torch.Tensor | None:
    """None, the int N, or the token map as an int64 CPU tensor [N]; ConfigError naming what is wrong."""
    if draft_vocab is None:
        return None
    if isinstance(draft_vocab, int) and not isinstance(draft_vocab, bool):
        if not 1 <= draft_vocab <= vocab_size:
            raise ConfigError(f"draft_vocab must be an int in [1, {vocab_size}] (the first N token ids) or a "
                              f"token map, got {draft_vocab!r}")
        return draft_vocab
    if isinstance(draft_vocab, (bool, float, str, bytes, dict)) or not hasattr(draft_vocab, "__len__"):
        raise ConfigError(f"draft_vocab must be an int in [1, {vocab_size}] (the first N token ids) or a token map "
                          f"(a 1-D sequence of distinct token ids), got {type(draft_vocab).__name__}")
    if not isinstance(draft_vocab, torch.Tensor) and any(isinstance(t, bool) for t in draft_vocab):
        raise ConfigError("draft_vocab token map: ids must be ints, got a bool")
    try:
        ids = torch.as_tensor(draft_vocab, device="cpu")
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"draft_vocab token map: not a 1-D sequence of token ids ({e})") from None
    if ids.dim() != 1:
        raise ConfigError(f"draft_vocab token map must be 1-D, got shape {tuple(ids.shape)}")
    n = ids.numel()
    if n == 0:
        raise ConfigError("draft_vocab token map is empty")
    if ids.dtype not in _INT_DTYPES:
        raise ConfigError(f"draft_vocab token map: ids must be integers, got dtype {ids.dtype}")
    if n > vocab_size:
        raise ConfigError(f"draft_vocab token map has {n} ids, more than the vocabulary's {vocab_size}")
    ids = ids.to(torch.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise ConfigError(f"draft_vocab token map: ids must be in [0, {vocab_size}), got {bad[:8].tolist()}")
    uniq, counts = torch.unique(ids, return_counts=True)
    if uniq.numel() != n:
        raise ConfigError(f"draft_vocab token map: ids must be distinct, repeated: {uniq[counts > 1][:8].tolist()}")
    return ids


def describe_draft_vocab(draft_vocab, vocab_size: int) -> dict:
    """{"kind": "first" | "map", "size": N}: a valid draft_vocab as given (None: the first vocab_size ids)."""
    if draft_vocab is None or isinstance(draft_vocab, int):
        return {"kind": "first", "size": vocab_size if draft_vocab is None else draft_vocab}
    return {"kind": "map", "size": len(draft_vocab)}
