"""router/logprobs.py against vLLM 0.32's own code on the same tokens: the per-token strings
(convert_ids_list_to_tokens + LogprobsProcessor's U+FFFD correction) on a byte-level tokenizer
splitting multi-byte characters and on the tiny checkpoints' Metaspace tokenizer, and the chat /
completions entries as vLLM's servers build them from one position's logprob map."""
import types

import pytest
from tokenizers import Tokenizer

from nexrt_vllm.router.logprobs import Logprobs, TokenTexts
from nexrt_vllm.testing.vllm_parsers import parser_tokenizer

TEXTS = ["café 東京 😀 naïve", "  two  spaces\tand tab", "<think>\nok\n</think>\n\n{\"a\": \"ü\"}"]


def _vllm_strings(fast, ids):
    """vLLM's decoded_token of each sampled token of `ids` (context: the preceding sampled ones)."""
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.v1.engine.logprobs import LogprobsProcessor

    p = types.SimpleNamespace(tokenizer=fast)
    p._correct_decoded_token = lambda t, ctx: LogprobsProcessor._correct_decoded_token(p, t, ctx)
    out = []
    for j, tid in enumerate(ids):
        decoded = convert_ids_list_to_tokens(fast, [tid])
        out.append(LogprobsProcessor._verify_tokens(p, decoded, [tid], ids[max(0, j - 4):j])[0])
    return out


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    fast = parser_tokenizer()
    d = str(tmp_path_factory.mktemp("bl"))
    fast.save_pretrained(d)
    return fast, TokenTexts(Tokenizer.from_file(d + "/tokenizer.json"))


@pytest.fixture(scope="module")
def metaspace(ckpt_factory):
    from transformers import AutoTokenizer
    path = ckpt_factory("qwen3_5", "bfloat16")
    return AutoTokenizer.from_pretrained(path), TokenTexts(Tokenizer.from_file(path + "/tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS)
def test_token_strings_equal_vllm_byte_level(byte_level, text):
    fast, texts = byte_level
    ids = fast.encode(text, add_special_tokens=False)
    assert any(fast.decode([i]).endswith("\ufffd") for i in ids) or "東" not in text  # the correction is exercised
    assert [texts.text(t, ids[:j]) for j, t in enumerate(ids)] == _vllm_strings(fast, ids)


def test_token_strings_equal_vllm_metaspace(metaspace):
    fast, texts = metaspace
    ids = fast.encode(" alpha beta gamma delta", add_special_tokens=False) + list(range(0, 40))
    assert [texts.text(t, ids[:j]) for j, t in enumerate(ids)] == _vllm_strings(fast, ids)
    assert texts.text(ids[0], [])[0] == " "  # the leading space decode([id]) drops is restored


def test_entries_as_vllm_builds_them(byte_level):
    """A position's map is {sampled: lp, top...}: chat lists its first k entries, completions its
    first k + 1 (so a sampled token outside the top k is listed); -inf is -9999.0."""
    fast, texts = byte_level
    a, b, c = (fast.convert_tokens_to_ids(x) for x in ("a", "b", "c"))
    chat = Logprobs(texts, chat=True, k=2)
    chat.add_vllm_first(a, {"content": [{"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": []}]})
    chat.add_node(c, {"token": c, "logprob": -3.0, "top_logprobs": [[a, -0.2], [b, float("-inf")]]})
    e = chat.whole()["content"][1]
    assert e == {"token": "c", "logprob": -3.0, "bytes": [99], "top_logprobs": [
        {"token": "c", "logprob": -3.0, "bytes": [99]}, {"token": "a", "logprob": -0.2, "bytes": [97]}]}
    cmpl = Logprobs(texts, chat=False, k=2)
    cmpl.add_vllm_first(a, {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [{"a": -0.1}],
                            "text_offset": [0]})
    cmpl.add_node(c, {"token": c, "logprob": -3.0, "top_logprobs": [[a, -0.2], [b, float("-inf")]]})
    cmpl.add_node(a, {"token": a, "logprob": -0.2, "top_logprobs": [[a, -0.2], [b, -2.0]]})
    w = cmpl.whole()
    assert w["tokens"] == ["a", "c", "a"] and w["text_offset"] == [0, 1, 2]
    assert w["top_logprobs"][1] == {"c": -3.0, "a": -0.2, "b": -9999.0}
    assert w["top_logprobs"][2] == {"a": -0.2, "b": -2.0}
    assert cmpl.pending() == w and cmpl.pending() is None   # streamed once
