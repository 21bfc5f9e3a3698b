"""The router overhead benchmark runs end to end and writes its JSON (numbers are positive and
consistent: every streamed token was matched to its emit time)."""
import json
import os
import subprocess
import sys

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
    for k in ("p50", "p99"):
        assert res["added_ttft_ms"][k] > 0 and k in res["added_per_token_ms"]
        assert res["raw"]["ttft_router_ms"][k] > res["raw"]["prefill_direct_ms"][k]
