"""Router-side detokenization and stop strings: same output however the text/tokens are chunked."""
import random

import pytest
from tokenizers import Tokenizer

from nexrt_vllm.router.textstream import Detokenizer, StopStrings, _priming
from nexrt_vllm.testing import make_tokenizer


def run(stops, chunks):
    s = StopStrings(stops)
    out = "".join(s.push(c) for c in chunks)
    return out + s.flush(), s.stopped


def all_chunkings(text, rng, n=60):
    yield [text]
    yield list(text)
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(6, len(text) - 1))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("stops,text,expected,stopped", [
    ([], "hello world", "hello world", False),
    (["wor"], "hello world", "hello ", True),
    (["xyz"], "hello world", "hello world", False),
    (["abc", "b"], "xxabc", "xxa", True),          # "b" completes before "abc" does
    (["ab", "b"], "xxab", "xx", True),              # same end: the longer (earlier) match wins
    (["lo w", "world"], "hello world", "hel", True),
    (["\n\n"], "a\nb\n\nc", "a\nb", True),
    (["d"], "hello world", "hello worl", True),
])
def test_stop_strings_independent_of_chunking(stops, text, expected, stopped):
    rng = random.Random(0)
    for chunks in all_chunkings(text, rng):
        assert run(stops, chunks) == (expected, stopped), chunks


def test_hold_back_never_leaks_a_stop_prefix():
    s = StopStrings(["STOP"])
    sent = s.push("abcST")
    assert sent == "ab"          # "cST" could still start "STOP"... only the safe prefix goes out
    sent += s.push("O")
    assert "S" not in sent
    assert s.push("P") == "" and s.stopped
    assert s.flush() == ""


def test_detokenizer_matches_full_decode(tmp_path):
    make_tokenizer(str(tmp_path))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    prompt = tok.encode("the quick brown fox").ids
    rng = random.Random(1)
    ids = [rng.randrange(tok.get_vocab_size()) for _ in range(200)]
    d = Detokenizer(tok, prompt)
    streamed = "".join(d.step(i) for i in ids)
    # Same rule as vLLM: the text of the output is decode(prompt+out) minus decode(prompt).
    full = tok.decode(prompt + ids, skip_special_tokens=True)
    assert streamed == full[len(tok.decode(prompt, skip_special_tokens=True)):]
    # A leading word token keeps its space after a prompt (DecodeStream primed with the prompt).
    word = next(i for t, i in tok.get_vocab().items() if t.startswith("▁") and len(t) > 2)
    assert Detokenizer(tok, prompt).step(word) == " " + tok.id_to_token(word)[1:]


def _byte_level_tokenizer() -> Tokenizer:
    """A byte-level BPE like Qwen's: multi-byte characters split over byte tokens."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["快速的棕色狐狸跳过了懒狗 🦊🐶 naïve café — déjà vu", "the quick brown fox 😀 über straße"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.mark.parametrize("byte_level", [False, True])
def test_detokenizer_short_priming_equals_whole_prompt(tmp_path, byte_level):
    """The router primes with the prompt's tail; every delta equals vLLM's stream primed with the
    whole prompt, including prompts and outputs that end or start inside a UTF-8 character."""
    from tokenizers.decoders import DecodeStream

    if byte_level:
        tok = _byte_level_tokenizer()
    else:
        make_tokenizer(str(tmp_path))
        tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    n = tok.get_vocab_size()
    singles = [i for i in range(n) if "\ufffd" in tok.decode([i])]  # byte fragments
    wholes = [i for i in range(n) if i not in singles]
    assert not byte_level or len(singles) > 20
    rng = random.Random(2)
    short_with_fragments = 0
    for case in range(900):
        frag = (0.0, 0.08, 0.5)[case % 3] if singles else 0.0  # share of byte-fragment tokens
        pick = lambda: rng.choice(singles) if rng.random() < frag else rng.choice(wholes)  # noqa: E731
        prompt = [pick() for _ in range(rng.randint(0, 40))]
        out = [pick() for _ in range(30)]
        primed = _priming(tok, prompt, True)
        short_with_fragments += len(primed) < len(prompt) and any(i in singles for i in prompt)
        ref = DecodeStream(ids=list(prompt), skip_special_tokens=True)
        d = Detokenizer(tok, prompt)
        for i in out:
            try:
                want = ref.step(tok, i) or ""
            except Exception as e:  # the reference hit tokenizers' invalid-prefix case: restarts as vLLM does
                assert "Invalid prefix" in str(e)
                break
            assert d.step(i) == want, (prompt, out)
    assert not byte_level or short_with_fragments > 50
