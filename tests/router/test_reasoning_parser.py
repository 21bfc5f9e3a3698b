"""Router `<think>` splitting (qwen3 reasoning parser) gives what vLLM's own parser gives.

Checked against vLLM 0.32 on the same texts: non-streaming (reasoning, content), streaming one
token per delta (each delta's JSON) and at every cut point, the reasoning-token count, and where
the prompt leaves reasoning open (with or without `<think>` in the prompt, thinking off).
"""
import pytest

from nexrt_vllm.router.chat_parser import ChatOptions
from nexrt_vllm.router.reasoning import Qwen3ReasoningParser, get_reasoning_parser
from nexrt_vllm.testing.vllm_parsers import Pair, parser_tokenizer

TURN = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = {
    "qwen3": TURN,
    "qwen3_5_think_in_prompt": TURN + "<think>\n",
    "thinking_off": TURN + "<think>\n\n</think>\n\n",
    "earlier_turn_reasoned": "<|im_start|>assistant\n<think>\nx\n</think>\n\nok<|im_end|>\n" + TURN,
}
TEXTS = {
    "with_open": "<think>\nStep 1: add.\nStep 2: done.\n</think>\n\nThe answer is 4.",
    "without_open": "Step 1.\n</think>\n\nAnswer: 4.",
    "never_closed": "<think>\nStill thinking when max_tokens hit",
    "no_markup": "Direct answer without reasoning.",
    "empty_reasoning": "<think>\n\n</think>\n\nHi.",
    "only_reasoning": "<think>x</think>",
    "repeated_end": "a</think>b</think>c",
    "second_block": "<think>a</think>b<think>c</think>d",
    "unicode": "<think>\n東京 😀 café\n</think>\nZürich ✓",
    "angle_brackets": "<think>\nis 3 < 4? 5 > 2 </thin\n</think>\n<b>bold</b> <thinking>",
    "tool_markup_after": "<think>\nok\n</think>\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
    "tool_call_ends_reasoning": "<think>\nok\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "special_tokens": "<think>a<|endoftext|>b</think>c<|endoftext|>d",
    "whitespace_after_end": "<think>a</think>\n\n",
}
OPTIONS = {"default": ChatOptions(), "thinking_off": ChatOptions(thinking=False),
           "hide_reasoning": ChatOptions(include_reasoning=False)}


@pytest.fixture(scope="module")
def tok():
    return parser_tokenizer()


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("opt", OPTIONS)
@pytest.mark.parametrize("name", TEXTS)
def test_same_as_vllm(tok, name, opt):
    text, pair = TEXTS[name], Pair(tok, OPTIONS[opt], "qwen3", None)
    mine, ref = pair.parse(text)
    assert mine == ref, "non-streaming"
    for prompt in PROMPTS.values():
        pair.assert_token_stream_same(text, _ids(tok, prompt), f" after {prompt!r}")
    if opt == "default":
        pair.assert_split_streams_same(text, _ids(tok, PROMPTS["qwen3"]))


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_state_same_as_vllm(tok, prompt, thinking):
    pair = Pair(tok, ChatOptions(thinking=thinking), "qwen3", None)
    ids = _ids(tok, PROMPTS[prompt])
    mine = Qwen3ReasoningParser(thinking=thinking, token_id=tok.get_vocab().get).prompt_reasoning_ended(ids)
    assert mine == pair.vllm.parser.is_reasoning_end(ids)


@pytest.mark.parametrize("defaults", [None, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("extra", [
    {}, {"chat_template_kwargs": {"enable_thinking": False}}, {"chat_template_kwargs": {"enable_thinking": True}},
    {"chat_template_kwargs": {"enable_thinking": None}}, {"chat_template_kwargs": {"enable_thinking": "auto"}},
    {"reasoning_effort": "none"}, {"reasoning_effort": "low"},
    {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}])
def test_thinking_resolved_as_vllm(extra, defaults):
    """vLLM builds the parser with the request's chat-template kwargs merged with the server's."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    kwargs = ChatCompletionRequest(**body).build_chat_params(None, "auto").with_defaults(
        defaults).chat_template_kwargs
    assert ChatOptions.from_request(body, defaults).thinking == bool(kwargs.get("enable_thinking", True))


def test_split_with_and_without_opening_tag():
    p = Qwen3ReasoningParser()
    assert p.split(TEXTS["with_open"]) == ("\nStep 1: add.\nStep 2: done.\n", "\n\nThe answer is 4.")
    assert p.split(TEXTS["without_open"]) == ("Step 1.\n", "\n\nAnswer: 4.")
    assert p.split(TEXTS["never_closed"]) == ("\nStill thinking when max_tokens hit", None)
    assert Qwen3ReasoningParser(thinking=False).split(TEXTS["with_open"]) == (None, TEXTS["with_open"])


def test_stream_holds_a_partial_end_tag_then_switches():
    p = Qwen3ReasoningParser()
    out = [p.stream(d, 1) for d in ("<think>", "plan", "</th", "ink>", "Answer")]
    assert out == [None, {"reasoning": "plan"}, None, None, {"content": "Answer"}]
    assert p.ended


def test_unknown_parser_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown reasoning parser 'deepseek'.*qwen3"):
        get_reasoning_parser("deepseek")
