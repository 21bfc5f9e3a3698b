"""Random prompts the way InferenceX builds them: lengths in [0.8 L, L], exact token counts, seed 0.

The digests were produced by the official client (SemiAnalysisAI/InferenceX@843c6254f,
`sample_random_requests`, transformers tokenizer, `np.random.seed(0)`) on the same tiny tokenizer;
our `tokenizers`-only port must give byte-identical prompts.
"""
import hashlib

import pytest

from nexrt_vllm.bench.inferencex import BenchmarkError, PromptTokenizer, sample_random_requests
from nexrt_vllm.testing import make_tokenizer

UPSTREAM = {  # use_chat_template -> (input lens, sha256 of "\0".join(prompts)) for 64/16 x 20
    False: ([63, 56, 51, 54, 62, 54, 58, 60, 54, 56, 53, 55, 58, 57, 59, 59, 63, 61, 52, 57],
            "fdace5db67fcbcda6e4c914b6faa10d59eb5590584ea947ddb0211dedc57bd20"),
    True: ([58, 54, 56, 64, 56, 60, 62, 57, 58, 55, 57, 60, 60, 61, 61, 63, 54, 63, 61, 60],
           "1a31ca162382cc7c3387dbcc1d59cdae1ed72326f3979071ed693f840490444f"),
}
UPSTREAM_OUTPUT_LENS = [12, 13, 13, 12, 13, 16, 15, 12, 15, 12, 14, 15, 12, 13, 15, 15, 15, 12,
                        13, 13]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(str(d))
    return PromptTokenizer(str(d))


@pytest.mark.parametrize("chat", [False, True])
def test_identical_to_official_client(tok, chat):
    reqs = sample_random_requests(tok, 64, 16, 20, 0.8, seed=0, use_chat_template=chat)
    lens, digest = UPSTREAM[chat]
    assert [r.prompt_len for r in reqs] == lens
    assert [r.output_len for r in reqs] == UPSTREAM_OUTPUT_LENS
    assert hashlib.sha256("\0".join(r.prompt for r in reqs).encode()).hexdigest() == digest
    if chat:
        assert reqs[0].prompt.startswith("<|im_start|>user\n")
        assert reqs[0].prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_lengths_exact_and_in_range(tok):
    reqs = sample_random_requests(tok, 300, 40, 50, 0.8, seed=3)
    for r in reqs:
        assert 240 <= r.prompt_len <= 300
        assert 32 <= r.output_len <= 40
        assert len(tok.encode(r.prompt)) == r.prompt_len
    assert len({r.prompt for r in reqs}) == 50
    again = sample_random_requests(tok, 300, 40, 50, 0.8, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    other = sample_random_requests(tok, 300, 40, 50, 0.8, seed=4)
    assert [r.prompt for r in other] != [r.prompt for r in reqs]


def test_range_ratio_one_gives_fixed_lengths(tok):
    reqs = sample_random_requests(tok, 32, 8, 10, 1.0)
    assert {r.prompt_len for r in reqs} == {32} and {r.output_len for r in reqs} == {8}


def test_bad_inputs(tok, tmp_path):
    with pytest.raises(BenchmarkError, match="must be >= 1"):
        sample_random_requests(tok, 0, 8, 4)
    with pytest.raises(BenchmarkError, match="range_ratio"):
        sample_random_requests(tok, 8, 8, 4, range_ratio=1.5)
    with pytest.raises(BenchmarkError, match="shorter than the chat template"):
        sample_random_requests(tok, 3, 8, 4, use_chat_template=True)
    with pytest.raises(BenchmarkError, match="no tokenizer.json"):
        PromptTokenizer(str(tmp_path))
