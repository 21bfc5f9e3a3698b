"""Agentic traces in the spirit of InferenceX's AgentX (its Claude Code replays are not reachable
here, so these are synthetic, in the same shape): per conversation a list of requests, each with
its input and output length, the hash ids of its prompt's blocks (equal ids: equal blocks, shared
with the previous turn and, for the system prompt, with other conversations) and the think time
before it.

    {"block_size": 64, "conversations": [{"id": "c0", "requests": [
        {"input_length": 1024, "output_length": 32, "hash_ids": [0, 1, ..., 15], "think_time_s": 0.0},
        {"input_length": 1312, "output_length": 32, "hash_ids": [0, ..., 15, 1000, ...], "think_time_s": 2.0},
        ...]}]}

A turn's prompt is the last turn's prompt, the last answer and a tool result (new blocks); the
replay (benchmarks/agentic_replay.py) builds it from the answers it really got, as an agent does,
and the new blocks' tokens from their hash ids (``block_tokens``). Pure Python.
"""
from __future__ import annotations

import random
import statistics


def synthesize(conversations: int, turns: int, first: int, tool: int, output: int, *, system: int = 0,
               block_size: int = 64, think_s: float = 2.0, jitter: float = 0.25, seed: int = 0) -> dict:
    """Conversations of ``turns`` requests: the first prompt ``first`` tokens (its first ``system``
    tokens shared by every conversation), each later one the last prompt + the last answer
    (``output`` tokens) + a tool result of about ``tool`` tokens (+- ``jitter``)."""
    rng = random.Random(seed)
    next_id = [1_000_000]

    def new_ids(n_tokens: int) -> list[int]:
        ids = list(range(next_id[0], next_id[0] + -(-n_tokens // block_size)))
        next_id[0] += len(ids) + 1
        return ids

    shared = list(range(-(-system // block_size))) if system else []
    convs = []
    for c in range(conversations):
        reqs, length, ids = [], first, shared + new_ids(first - len(shared) * block_size)
        for t in range(turns):
            if t:
                added = output + max(1, round(tool * (1 + rng.uniform(-jitter, jitter))))
                length += added
                ids = ids + new_ids(added)
            reqs.append({"input_length": length, "output_length": output, "hash_ids": list(ids),
                         "think_time_s": 0.0 if t == 0 else round(think_s * rng.uniform(0.5, 1.5), 3)})
        convs.append({"id": f"c{c}", "requests": reqs})
    return {"block_size": block_size, "conversations": convs}


def block_tokens(hash_id: int, block_size: int, vocab: tuple[int, int], salt: int = 0) -> list[int]:
    """The tokens of a block: a function of its hash id (and ``salt``: another run's own contents)."""
    rng = random.Random(hash_id * 1_000_003 + salt)
    return [rng.randrange(*vocab) for _ in range(block_size)]


def interleaved(trace: dict) -> list[tuple[int, int]]:
    """(conversation index, turn index) in replay order: every conversation's turn 1, then turn 2, ...
    (so a node holds several conversations between their turns)."""
    convs = trace["conversations"]
    turns = max(len(c["requests"]) for c in convs)
    return [(c, t) for t in range(turns) for c in range(len(convs)) if t < len(convs[c]["requests"])]


def summarize(turns: list[dict]) -> dict:
    """Medians per turn index (and over turns after the first) of the replay's per-request records."""
    def med(rows, key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    by_turn = {}
    for t in sorted({r["turn"] for r in turns}):
        rows = [r for r in turns if r["turn"] == t]
        by_turn[t] = {k: med(rows, k) for k in ("input_tokens", *KEYS)}
    later = [r for r in turns if r["turn"] > 0]
    return {"by_turn": by_turn, "later_turns": {k: med(later, k) for k in KEYS}}


# per request: at the client, from the node's /metrics, and the router's own timing (NexRT turns)
KEYS = ("ttft_s", "second_token_s", "tpot_s", "handoff_bytes", "held_tokens", "queue_s", "prefill_s", "transfer_s")
