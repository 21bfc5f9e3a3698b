"""Engine.generate / stream: stop conditions, EOS, max tokens, a full context, seeds, bad input."""
import dataclasses

import pytest
import torch

from nexrt_vllm.engine import Engine, InputError, SamplingParams, StateError

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 128, 200, 33]


@pytest.fixture(scope="module")
def eng(qwen3_5_ckpt):
    return Engine.from_pretrained(qwen3_5_ckpt, max_seq_len=96, progress=False)


@pytest.fixture(scope="module")
def greedy(eng):
    toks = eng.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert len(toks) == 24 and eng.finish_reason == "length"
    return toks


def _first_repeat_free_index(toks, start):
    """An index i >= start whose token does not occur before it (so stopping on it stops exactly there)."""
    return next(i for i in range(start, len(toks)) if toks[i] not in toks[:i])


def test_stop_token_ends_generation_and_is_emitted(eng, greedy):
    i = _first_repeat_free_index(greedy, 4)
    out = eng.generate(PROMPT, max_new_tokens=24, stop_token_ids=[greedy[i]], ignore_eos=True)
    assert out == greedy[: i + 1] and eng.finish_reason == "stop"


def test_eos_stops_unless_ignore_eos(eng, greedy):
    i = _first_repeat_free_index(greedy, 3)
    cfg = eng.config
    eng.config = dataclasses.replace(cfg, eos_token_ids=(greedy[i],))
    try:
        assert eng.generate(PROMPT, max_new_tokens=24) == greedy[: i + 1]
        assert eng.finish_reason == "stop"
        assert eng.generate(PROMPT, max_new_tokens=24, ignore_eos=True) == greedy
        # a stop id still stops with ignore_eos
        assert eng.generate(PROMPT, max_new_tokens=24, ignore_eos=True, stop_token_ids=[greedy[i]]) == greedy[: i + 1]
    finally:
        eng.config = cfg


def test_max_tokens_counts_the_first_token(eng, greedy):
    assert eng.generate(PROMPT, max_new_tokens=1, ignore_eos=True) == greedy[:1]
    eng.prefill(PROMPT)
    # stream: max_tokens counts first_token, so it yields max_tokens - 1
    assert list(eng.stream(greedy[0], SamplingParams(max_tokens=5, ignore_eos=True))) == greedy[1:5]
    assert eng.finish_reason == "length" and eng.state.seq_len == len(PROMPT) + 4


def test_stream_yields_nothing_when_first_token_stops(eng, greedy):
    eng.prefill(PROMPT)
    assert list(eng.stream(greedy[0], SamplingParams(max_tokens=10, stop_token_ids=[greedy[0]]))) == []
    assert eng.finish_reason == "stop" and eng.state.seq_len == len(PROMPT)


def test_full_context_ends_with_length(qwen3_5_ckpt, greedy):
    small = Engine.from_pretrained(qwen3_5_ckpt, max_seq_len=len(PROMPT) + 4, progress=False)
    out = small.generate(PROMPT, max_new_tokens=50, ignore_eos=True)
    # 4 free rows: the tokens decoded into them plus the last sampled token
    assert out == greedy[:5] and small.finish_reason == "length"
    with pytest.raises(StateError, match="context is full"):
        small.decode_step(out[-1])


def test_seeded_generate_is_reproducible(eng):
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=50, ignore_eos=True)
    a = eng.generate(PROMPT, seed=11, **kw)
    assert eng.generate(PROMPT, seed=11, **kw) == a
    assert eng.generate(PROMPT, seed=12, **kw) != a


def test_bad_requests_raise_typed_errors(eng, qwen3_5_ckpt):
    with pytest.raises(InputError, match="empty"):
        eng.prefill([])
    with pytest.raises(InputError, match=r"\[0, 384\)"):
        eng.prefill([1, 2, 384])
    with pytest.raises(InputError, match="max_seq_len is 96"):
        eng.prefill([1] * 97)
    with pytest.raises(InputError, match="token ids"):
        eng.decode_step(-1)
    fresh = Engine.from_pretrained(qwen3_5_ckpt, max_seq_len=16, progress=False)
    with pytest.raises(StateError, match="before prefill"):
        fresh.decode_step(3)
    with pytest.raises(StateError, match="before prefill"):
        fresh.stream(3, SamplingParams())  # refused at the call, not at the first next()
    with pytest.raises(TypeError, match="SamplingParams"):
        eng.stream(3, {"max_tokens": 4})


def test_decode_step_keeps_buffers_static(eng):
    """What a CUDA graph needs: the step writes in place and advances the device-side position."""
    eng.prefill(PROMPT)
    ptrs = [t.data_ptr() for t in eng.state.buffers()]
    pos_ptr = eng.state.position.data_ptr()
    for tok in (3, 4, 5):
        eng.decode_step(tok)
    assert [t.data_ptr() for t in eng.state.buffers()] == ptrs
    assert eng.state.position.data_ptr() == pos_ptr
    assert int(eng.state.position) == eng.state.seq_len == len(PROMPT) + 3
    assert torch.all(eng.state.attention(eng.config.attention_layers[0]).k[:, len(PROMPT) + 2] != 0)
