"""InferenceX's per-request timing of an SSE stream (TTFT, per-chunk ITL, E2EL, usage tokens).

The clock is scripted: each parsed (non-[DONE]) line reads it once, so every value is hand-computed.
"""
import asyncio
import json

import pytest

from nexrt_vllm.bench.inferencex import RequestOutput, calculate_metrics, consume_stream


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n"


def chat(content, role=None):
    delta = {"content": content}
    if role:
        delta["role"] = role
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def comp(text):
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def usage(n):
    return {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                     "total_tokens": 7 + n}}


async def _lines(items):
    for item in items:
        yield item


def run(lines, times, is_chat, st=100.0):
    ticks = iter(times)
    out = RequestOutput(prompt_len=7)
    asyncio.run(consume_stream(_lines(lines), st, out, is_chat, clock=lambda: next(ticks)))
    assert next(ticks, None) is None, "every parsed line reads the clock exactly once"
    return out


def test_chat_multi_token_chunk_itl_differs_from_tpot():
    # role-only delta at +0.5 s is the first token time; "b c" is ONE chunk of 2 tokens.
    lines = [sse(chat("", role="assistant")), b"\n", sse(chat("a")), sse(chat(" b c")),
             sse(chat("d")), sse(usage(4)), sse(b"[DONE]")]
    out = run(lines, [100.5, 100.6, 100.9, 101.0, 101.05], is_chat=True)
    assert out.success and out.error == ""
    assert out.ttft == pytest.approx(0.5)
    assert out.itl == pytest.approx([0.1, 0.3, 0.1])          # per chunk: 3 gaps
    assert out.latency == pytest.approx(1.05)                 # chat E2EL ends at the usage chunk
    assert out.output_tokens == 4
    assert out.generated_text == "a b cd"
    m, lens = calculate_metrics([out], duration_s=2.0)
    # TPOT = (1.05 - 0.5) / (4 - 1) = 0.18333 s, while mean ITL = 0.5 / 3 = 0.16667 s
    assert m["mean_tpot_ms"] == pytest.approx(550.0 / 3)
    assert m["mean_itl_ms"] == pytest.approx(500.0 / 3)
    assert m["mean_tpot_ms"] != pytest.approx(m["mean_itl_ms"])
    assert lens == [4]


def test_completions_e2el_ends_at_last_choice_chunk():
    # Upstream's completions function does not stamp the usage chunk: E2EL = last text chunk.
    lines = [sse(comp("x")), sse(comp("yz")), sse(usage(3)), sse(b"[DONE]")]
    out = run(lines, [100.2, 100.5, 100.7], is_chat=False)
    assert out.success
    assert out.ttft == pytest.approx(0.2)
    assert out.itl == pytest.approx([0.3])
    assert out.latency == pytest.approx(0.5)
    assert out.output_tokens == 3
    assert out.generated_text == "xyz"


def test_no_usage_chunk_counts_zero_tokens_like_upstream():
    out = run([sse(comp("x")), sse(comp("y"))], [100.1, 100.2], is_chat=False)
    assert out.success and out.output_tokens == 0
    m, lens = calculate_metrics([out], duration_s=1.0)
    assert lens == [0] and m["total_output_tokens"] == 0
    assert m["mean_tpot_ms"] == 0.0  # no TPOT sample: upstream reports 0, not NaN


def test_error_event_fails_the_request():
    lines = [sse(chat("", role="assistant")), sse(chat("a")),
             sse({"error": {"message": "decode node lost", "code": 502}}), sse(b"[DONE]")]
    out = run(lines, [100.1, 100.2, 100.3], is_chat=True)
    assert not out.success
    assert "decode node lost" in out.error


@pytest.mark.parametrize("is_chat", [True, False])
def test_stream_without_choices_fails(is_chat):
    out = run([sse(usage(0)), sse(b"[DONE]")], [100.1], is_chat=is_chat)
    assert not out.success
    assert "Never received a valid chunk" in out.error


def test_malformed_line_raises_for_the_caller_to_mark_failed():
    with pytest.raises(json.JSONDecodeError):
        run([sse(comp("x")), b"data: {not json\n"], [100.1, 100.2], is_chat=False)
