"""gpu_e2e's concurrency sweep summary (`--conc 1 2 4 8`): the Pareto points count one GPU per path,
NexRT is compared at each concurrency with the baseline of higher median interactivity there (plain
vLLM or vLLM + MTP), its throughput scaling is against its own concurrency 1, and the chart is drawn."""
import os

import pytest

from benchmarks.gpu_e2e import add_sweep


def _r(tpot_ms, ttft_ms, out_tok_s):
    return {"median_tpot_ms": tpot_ms, "median_ttft_ms": ttft_ms, "median_e2el_ms": 1000.0 + tpot_ms,
            "output_throughput": out_tok_s, "median_interactivity_tok_s": 1e3 / tpot_ms}


def test_sweep_ratios_pick_the_best_baseline_at_each_concurrency(tmp_path):
    summary = {"shape": "Qwen3.5-2B", "gpus": 1, "concurrency": {
        "nexrt": {"8k1k": {"1": _r(1.0, 50, 900), "4": _r(1.2, 55, 3000), "8": _r(1.5, 60, 4800)}},
        "vllm": {"8k1k": {"1": _r(2.5, 40, 380), "4": _r(3.0, 45, 1200), "8": _r(3.5, 50, 2100)}},
        "vllm_mtp": {"8k1k": {"1": _r(1.0 / 1.003, 45, 1000), "4": _r(1.745, 50, 1983), "8": _r(4.0, 52, 1900)}}}}
    png = str(tmp_path / "pareto.png")
    add_sweep(summary, ["8k1k"], png)
    by_c = summary["ratios_by_conc"]["8k1k"]
    assert by_c["1"]["baseline"] == "vllm_mtp" and by_c["1"]["interactivity_x"] == pytest.approx(1 / 1.003)
    assert by_c["4"]["baseline"] == "vllm_mtp" and by_c["4"]["interactivity_x"] == pytest.approx(1.745 / 1.2)
    assert by_c["8"]["baseline"] == "vllm" and by_c["8"]["interactivity_x"] == pytest.approx(3.5 / 1.5)
    assert by_c["8"]["output_throughput_x"] == pytest.approx(4800 / 2100)
    assert by_c["4"]["ttft_delta_ms"] == pytest.approx(5.0)
    assert summary["nexrt_throughput_scaling"]["8k1k"] == {"conc": 8, "output_tok_s_over_conc1": pytest.approx(4800 / 900)}
    pts = summary["pareto"]["8k1k"]
    assert [p["conc"] for p in pts["nexrt"]] == [1, 4, 8]
    assert pts["vllm"][2] == {"conc": 8, "tok_s_user": pytest.approx(1e3 / 3.5), "output_tok_s_gpu": 2100}
    assert os.path.getsize(png) > 1000
