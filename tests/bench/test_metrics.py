"""Aggregation of per-request outputs into InferenceX's raw fields, against hand-computed values."""
import numpy as np
import pytest

from nexrt_vllm.bench.inferencex import BenchmarkFailed, RequestOutput, calculate_metrics, check_failure_rate


def ok(ttft, latency, tokens, itl, prompt_len=10):
    return RequestOutput(success=True, ttft=ttft, latency=latency, output_tokens=tokens,
                         itl=list(itl), prompt_len=prompt_len)


def test_hand_computed_statistics():
    outs = [
        ok(0.1, 1.1, 11, [0.1] * 10, prompt_len=100),   # TPOT = 1.0/10 = 0.100
        ok(0.2, 2.2, 5, [0.5] * 4, prompt_len=80),      # TPOT = 2.0/4  = 0.500
        ok(0.3, 0.3, 1, [], prompt_len=90),             # 1 token: no TPOT sample
        RequestOutput(success=False, prompt_len=70, error="HTTP 500"),
    ]
    m, lens = calculate_metrics(outs, duration_s=4.0)
    assert lens == [11, 5, 1, 0]
    assert m["completed"] == 3
    assert m["total_input_tokens"] == 270                      # failed request not counted
    assert m["total_output_tokens"] == 17
    assert m["request_throughput"] == pytest.approx(0.75)
    assert m["output_throughput"] == pytest.approx(17 / 4)
    assert m["total_token_throughput"] == pytest.approx(287 / 4)
    # TPOT over [0.1, 0.5]
    assert m["mean_tpot_ms"] == pytest.approx(300.0)
    assert m["median_tpot_ms"] == pytest.approx(300.0)
    assert m["std_tpot_ms"] == pytest.approx(200.0)            # population std (ddof 0)
    assert m["p90_tpot_ms"] == pytest.approx(460.0)            # linear: 100 + 0.9*400
    assert m["p99_tpot_ms"] == pytest.approx(496.0)
    assert m["p99.9_tpot_ms"] == pytest.approx(499.6)
    # TTFT over [0.1, 0.2, 0.3], E2EL over [1.1, 2.2, 0.3]
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(np.sqrt(2 / 3) * 100)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)
    assert m["median_e2el_ms"] == pytest.approx(1100.0)
    assert m["mean_e2el_ms"] == pytest.approx(1200.0)
    # ITL pools every gap of every request: 10 x 0.1 and 4 x 0.5
    assert m["mean_itl_ms"] == pytest.approx((1.0 + 2.0) / 14 * 1000)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p90_itl_ms"] == pytest.approx(500.0)
    assert m["request_goodput:"] is None
    keys = [f"{s}_{n}_ms" for n in ("ttft", "tpot", "itl", "e2el")
            for s in ("mean", "median", "std", "p90", "p99", "p99.9")]
    assert [k for k in m if k.endswith("_ms")] == keys


def test_all_failed_reports_zeros():
    m, lens = calculate_metrics([RequestOutput(success=False, prompt_len=5)] * 3, duration_s=1.0)
    assert lens == [0, 0, 0] and m["completed"] == 0
    assert m["mean_ttft_ms"] == 0.0 and m["p99_e2el_ms"] == 0.0


@pytest.mark.parametrize("completed,n,fails", [(19, 20, False), (18, 20, True), (95, 100, False),
                                               (94, 100, True), (0, 16, True)])
def test_failure_threshold_is_five_percent(completed, n, fails):
    if fails:
        with pytest.raises(BenchmarkFailed, match="exceeds 5% threshold"):
            check_failure_rate(completed, n)
    else:
        check_failure_rate(completed, n)
