"""The router overhead benchmark runs end to end and writes its JSON (latencies are positive and
consistent: every streamed token was matched to its emit time, the added TTFT is the per-request
difference of the two measured legs). Which leg is faster is a measurement, not asserted: on shared
cores a single direct call can be the slower one."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_router_bench_writes_json(tmp_path):
    out = tmp_path / "rb.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.router_bench", "--requests", "3",
                        "--tokens", "5", "--out", str(out)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["added_ttft_ms"]["n"] == 3
    assert res["raw"]["token_latency_router_ms"]["n"] == 3 * 4
    assert res["raw"]["token_latency_direct_ms"]["n"] == 3 * 4
    raw = res["raw"]
    for name in ("ttft_router_ms", "prefill_direct_ms", "token_latency_router_ms", "token_latency_direct_ms"):
        assert raw[name]["p50"] > 0 and raw[name]["p99"] >= raw[name]["p50"], (name, raw[name])
    assert res["added_ttft_ms"]["mean"] == pytest.approx(
        raw["ttft_router_ms"]["mean"] - raw["prefill_direct_ms"]["mean"])
    for k in ("p50", "p90", "p99", "mean"):
        assert res["added_per_token_ms"][k] == pytest.approx(
            raw["token_latency_router_ms"][k] - raw["token_latency_direct_ms"][k])
