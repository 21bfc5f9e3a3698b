"""vLLM's own output parsers as the reference for the router's (tests only; imports vLLM).

`parser_tokenizer()` builds a small byte-level BPE tokenizer (every string encodes) with the Qwen
markup as added tokens, as Qwen3's tokenizer has them (`<think>`, `</think>`, `<tool_call>`,
`</tool_call>`, not special) plus ChatML specials. `VllmChat` drives vLLM's composed parser exactly
as vLLM's chat serving does (`parse` for non-streaming, `parse_delta` per output delta, then
`count_reasoning_tokens`) and returns results in the router parser's shapes.
"""
from __future__ import annotations

import json
import re

from nexrt_vllm.router.chat_parser import ChatOptions

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The weather in Paris is sunny today, and tomorrow it will rain.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
    "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
    "Let me think about this step by step. First, the user wants the answer.",
    "def f(x):\n    return x * 2  # code, quotes \" and \\ backslashes",
    "Zürich, Tōkyō 東京, emoji 😀, café — true false null 1.5 -3 [1, 2] {}",
]


def qwen3_coder_call(name: str, **params) -> str:
    """One tool call in Qwen3-Coder / Qwen3.5 markup (`<function=...><parameter=...>`)."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def hermes_call(name: str, args) -> str:
    """One tool call in Hermes / Qwen3 markup (JSON inside `<tool_call>`)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"


def parser_tokenizer(markers_special: bool = False):
    """A `transformers` fast tokenizer; `markers_special` marks the think/tool tokens special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   additional_special_tokens=SPECIALS
                                   + (MARKERS if markers_special else []))
    if not markers_special:
        fast.add_tokens(MARKERS)
    return fast


def per_token_deltas(tok, prompt_ids: list[int], text: str) -> list[tuple[str, list[int]]]:
    """The text as vLLM streams it: one (delta_text, [token_id]) per token (incremental detokenizer)."""
    from tokenizers.decoders import DecodeStream

    ids = tok.encode(text, add_special_tokens=False)
    stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=False)
    out = []
    for tid in ids:
        out.append((stream.step(tok.backend_tokenizer, tid) or "", [tid]))
    assert "".join(d for d, _ in out) == text, "test text does not round-trip through the tokenizer"
    return out


_ID_RE = re.compile(r"chatcmpl-tool-[0-9a-f]{16}")


def normalize_ids(s: str) -> str:
    return _ID_RE.sub("chatcmpl-tool-ID", s)


def delta_json(delta: dict | None) -> str | None:
    """A router delta as vLLM's chunk serializes its DeltaMessage (compact JSON, UTF-8 kept)."""
    if delta is None:
        return None
    return normalize_ids(json.dumps(delta, ensure_ascii=False, separators=(",", ":")))


class VllmChat:
    """vLLM's parser for one request, built the way `OpenAIServingChat` builds it."""

    def __init__(self, tok, opts: ChatOptions, *, reasoning_parser: str | None,
                 tool_parser: str | None):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.parser import ParserManager

        body: dict = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                      "include_reasoning": opts.include_reasoning,
                      "chat_template_kwargs": {"enable_thinking": opts.thinking}}
        if opts.tools is not None:
            body["tools"] = opts.tools
        if opts.tool_choice is not None:
            body["tool_choice"] = opts.tool_choice
        self.request = ChatCompletionRequest(**body)
        cls = ParserManager.get_parser(tool_parser_name=tool_parser,
                                       reasoning_parser_name=reasoning_parser,
                                       enable_auto_tools=True, model_name="m", tokenizer=tok)
        self._make = lambda: cls(tok, self.request.tools,
                                 chat_template_kwargs={"enable_thinking": opts.thinking})
        self.tok = tok
        self.parser = self._make()

    def parse(self, text: str):
        """(reasoning, content, tool_calls as [(name, arguments)] or None/[]) as the serving layer sees it."""
        reasoning, content, calls = self.parser.parse(text, self.request, enable_auto_tools=True,
                                                      model_output_token_ids=[])
        if not self.request.include_reasoning:
            reasoning = None
        if calls is not None:
            calls = [(c.name, c.arguments) for c in calls]
        return reasoning, content, calls

    def count_after_parse(self, text: str, token_ids: list[int]) -> int:
        p = self._make()
        p.parse(text, self.request, enable_auto_tools=True, model_output_token_ids=token_ids)
        return p.count_reasoning_tokens(token_ids)

    def stream(self, deltas: list[tuple[str, list[int]]], prompt_ids: list[int]):
        """→ (per-delta JSON or None, reasoning token count)."""
        p = self._make()
        out, ids = [], []
        for i, (text, tids) in enumerate(deltas):
            d = p.parse_delta(text, list(tids), self.request, prompt_token_ids=prompt_ids,
                              finished=i == len(deltas) - 1)
            ids.extend(tids)
            out.append(None if d is None else normalize_ids(d.model_dump_json(exclude_unset=True)))
        return out, p.count_reasoning_tokens(tuple(ids))


def router_chat(tok, opts: ChatOptions, *, reasoning_parser: str | None, tool_parser: str | None):
    """The router's parser for the same request, wired as the router wires it to a tokenizer."""
    from nexrt_vllm.router.chat_parser import ChatParser

    return ChatParser(opts, reasoning_parser=reasoning_parser, tool_parser=tool_parser,
                      drop_tokens=tuple(tok.all_special_tokens),
                      token_id=lambda s: tok.get_vocab().get(s))


def router_parse(parser, text: str):
    reasoning, content, calls = parser.parse(text)
    if calls is not None:
        calls = [(c["name"], c["arguments"]) for c in calls]
    return reasoning, content, calls


def router_stream(parser, deltas: list[tuple[str, list[int]]], prompt_ids: list[int]):
    out = [delta_json(parser.feed(text, finished=i == len(deltas) - 1, token_count=len(tids),
                                  prompt_ids=prompt_ids))
           for i, (text, tids) in enumerate(deltas)]
    return out, parser.count_reasoning_tokens([i for _, ids in deltas for i in ids],
                                              [t for t, _ in deltas])


def text_splits(text: str):
    """Every way to cut the text in two, then one delta per character (no token ids: vLLM's text path)."""
    for i in range(1, len(text)):
        yield [(text[:i], []), (text[i:], [])]
    yield [(c, []) for c in text]


class Pair:
    """vLLM's and the router's parser for one (tokenizer, options, parser names)."""

    def __init__(self, tok, opts: ChatOptions, reasoning_parser: str | None, tool_parser: str | None):
        self.tok, self.opts = tok, opts
        self.names = dict(reasoning_parser=reasoning_parser, tool_parser=tool_parser)
        self.vllm = VllmChat(tok, opts, **self.names)

    def router(self):
        return router_chat(self.tok, self.opts, **self.names)

    def parse(self, text: str):
        """(router, vLLM) non-streaming results."""
        return router_parse(self.router(), text), self.vllm.parse(text)

    def stream(self, deltas, prompt_ids):
        """(router, vLLM): per-delta JSON and the reasoning-token count."""
        return router_stream(self.router(), deltas, prompt_ids), self.vllm.stream(deltas, prompt_ids)

    def assert_token_stream_same(self, text: str, prompt_ids: list[int], where: str = "") -> None:
        """One delta per token: the deltas and the reasoning-token counts (streamed and not) equal vLLM's."""
        deltas = per_token_deltas(self.tok, prompt_ids, text)
        (mine_d, mine_n), (ref_d, ref_n) = self.stream(deltas, prompt_ids)
        assert mine_d == ref_d, f"per-token stream of {[d for d, _ in deltas]}{where}"
        assert mine_n == ref_n, "reasoning tokens, streaming"
        ids = [i for _, tids in deltas for i in tids]
        router = self.router()
        router.parse(text)
        assert (router.count_reasoning_tokens(ids, [d for d, _ in deltas])
                == self.vllm.count_after_parse(text, ids)), "reasoning tokens, non-streaming"

    def assert_split_streams_same(self, text: str, prompt_ids: list[int]) -> None:
        """The text cut at every position, and char by char: the deltas equal vLLM's."""
        for chunks in text_splits(text):
            (mine_d, _), (ref_d, _) = self.stream(chunks, prompt_ids)
            assert mine_d == ref_d, f"stream of {[c for c, _ in chunks]}"
