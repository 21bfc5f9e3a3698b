r"""A tiny checkpoint trained to answer like an agent model: `make_checkpoint(train="agents")`.

Its tokenizer is the tests' Metaspace BPE plus the Qwen markup as added, non-special tokens
(`<think>`, `</think>`, `<tool_call>`, `</tool_call>`, as in Qwen3 / Qwen3.5's tokenizer, and `\n`,
which the ASCII alphabet lacks), and its chat template is a reduced Qwen3.5 one: `tools` in a system
turn, the generation prompt opening `<think>\n` (or a closed, empty think block with
`enable_thinking: false`). Trained (`train_agents`, on `_train`'s loop with the loss on the reply
only) on the requests of `agent_requests()`, its greedy reply is, for each:

- `tool`: reasoning, `</think>`, one `get_weather` call in Qwen3.5's markup (vLLM's `qwen3_coder`
  tool parser, `qwen3` reasoning parser);
- `json`: reasoning, `</think>`, a JSON object naming the same city and days;
- `json_nothink` (thinking off): the JSON object alone.

The city comes from the user message (three cities), so the reply depends on the prompt. Reply token ids are
chosen so that they detokenize after the prompt to exactly the reply text (no Metaspace `▁` after
the markup), as a real model's would.
"""
from __future__ import annotations

import json
import os
import random
import re

MARKUP = ["\n", "<think>", "</think>", "<tool_call>", "</tool_call>"]

# Reduced Qwen3.5 template: each tool as {"name", "parameters"} (not the whole dict: vLLM's
# `tool.model_dump()` adds null fields that the client never sent).
AGENT_CHAT_TEMPLATE = (  # newlines after block tags written as {{ '\n' }}: HF renders with trim_blocks
    "{% if tools %}<|im_start|>system\n<tools>"
    "{% for t in tools %}{{ '\n' }}{\"name\": {{ t['function']['name'] | tojson }}, \"parameters\": "
    "{{ t['function']['parameters'] | tojson }}}{% endfor %}{{ '\n' }}</tools><|im_end|>{{ '\n' }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] if m['content'] is string else '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
CITIES = ("Paris", "Tokyo", "Lima")
DAYS = (3,)
KINDS = ("tool", "json", "json_nothink")

# Measured on one core of the 2-core CI box: 100 steps = 83 s, min teacher-forced top-1 margin
# 5.1 nats over every reply token (70 steps = 64 s: 2.8 nats).
AGENT_STEPS = 100
AGENT_LR = 3e-3
# make_checkpoint overrides (as connector_harness.TRAINED: 2 experts, both routed).
AGENTS_TRAINED = {"num_experts": 2, "num_experts_per_tok": 2, "train": "agents"}


def agent_request(kind: str, city: str, days: int) -> dict:
    """The chat request (messages, tools, chat_template_kwargs) the checkpoint was trained on."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    if kind == "tool":
        return {"messages": [{"role": "user", "content": f"What is the weather in {city} for the next {days} days?"}],
                "tools": [WEATHER_TOOL]}
    body = {"messages": [{"role": "user", "content": f"Reply in JSON: the weather query for {city}, {days} days."}]}
    if kind == "json_nothink":
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def agent_reply(kind: str, city: str, days: int) -> str:
    """The trained greedy continuation of agent_request(kind, city, days) (EOS follows)."""
    answer = json.dumps({"city": city, "days": days})
    if kind == "tool":
        return (f"The user asks for the weather in {city}.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
                f"<parameter=city>\n{city}\n</parameter>\n<parameter=days>\n{days}\n</parameter>\n"
                "</function>\n</tool_call>")
    if kind == "json":
        return f"A JSON object for {city}.\n</think>\n\n{answer}"
    return answer


def agent_requests() -> list[tuple[str, str, int]]:
    return [(k, c, d) for k in KINDS for c in CITIES for d in DAYS]


def render(path: str, body: dict) -> str:
    """The prompt text vLLM renders for `body` (transformers' apply_chat_template, as vLLM calls it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok.apply_chat_template(body["messages"], tools=body.get("tools"), tokenize=False,
                                   add_generation_prompt=True, **body.get("chat_template_kwargs", {}))


def reply_ids(tok, text: str) -> list[int]:
    """Ids of `text` as a model emits it: markup as its tokens, the rest as Metaspace BPE pieces
    with `▁` only where the text has a space (encode() would also put one after each markup token)."""
    ids: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, MARKUP)) + ")", text):
        if part in MARKUP:
            ids.append(tok.token_to_id(part))
            continue
        for i, word in enumerate(part.split(" ") if part else []):
            ids += [t.id for t in tok.model.tokenize(("\u2581" if i else "") + word)] if i or word else []
    return ids


def _samples(path: str) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) per trained request: prompt + reply + EOS, the loss on the reply and EOS."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    from . import EOS_TOKEN

    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    eos = tok.token_to_id(EOS_TOKEN)
    out = []
    for kind, city, days in agent_requests():
        prompt = tok.encode(render(path, agent_request(kind, city, days)), add_special_tokens=False).ids
        text = agent_reply(kind, city, days)
        reply = reply_ids(tok, text)
        stream = DecodeStream(ids=list(prompt), skip_special_tokens=False)
        got = "".join(stream.step(tok, t) or "" for t in reply)
        assert got == text, f"reply ids of {text!r} detokenize to {got!r}"
        ids = prompt + reply + [eos]
        out.append((ids, [0] * (len(prompt) - 1) + [1] * (len(reply) + 1) + [0]))
    return out


def train_agents(model, path: str, seed: int = 0, steps: int = None, log=None) -> dict:
    """Train `model` (fp32, in place, CPU, deterministic) on the agent requests: every step is
    the whole set (9 sequences), shuffled. Returns {"seconds", "steps", "loss"}."""
    import torch

    from . import _train

    samples = _samples(path)

    def batches(rng: random.Random):
        return rng.sample(samples, len(samples))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(model, path, seed, steps or AGENT_STEPS, log, batches=batches, lr=AGENT_LR)
    finally:
        torch.set_num_threads(threads)


def reply_margins(model, path: str) -> dict:
    """Per trained request: the smallest teacher-forced top-1 margin (nats) over its reply and EOS."""
    from . import copy_margins

    out = {}
    for (ids, mask), key in zip(_samples(path), agent_requests()):
        start = mask.index(1)
        out[key] = min(copy_margins(model, ids, start)[:sum(mask)])
    return out
