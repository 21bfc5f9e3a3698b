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


def test_merge_joins_sweeps_of_separate_runs(tmp_path):
    """Runs that measured different paths (or concurrencies) of one shape's sweep become one sweep, with the
    ratios against the best baseline at each concurrency and the Pareto chart drawn afresh."""
    import json

    from benchmarks.gpu_e2e import merge

    def run(name, path, by_c, **kw):
        r = {"command": f"gpu_e2e {path}", "shape": "Qwen3.5-2B", "layers": 24, "interleaved": False, "gpus": 1,
             "conc": sorted(map(int, by_c)), "nexrt": {}, "vllm": {}, "node": {}, "ratios": {"stale": 1},
             "concurrency": {path: {"8k1k": by_c}}, **kw}
        p = tmp_path / name
        p.write_text(json.dumps(r))
        return str(p)

    a = run("a.json", "nexrt", {"4": _r(1.06, 369, 2627), "8": _r(1.64, 258, 3722)}, max_batch=8)
    b = run("b.json", "vllm", {"4": _r(2.98, 217, 1184), "8": _r(3.07, 2726, 1198)})
    c = run("c.json", "nexrt", {"1": _r(0.7, 160, 1200)}, max_batch=8)
    out, png = str(tmp_path / "m.json"), str(tmp_path / "m.png")
    assert merge([a, b, c], out, png) == 0
    m = json.load(open(out))
    assert m["conc"] == [1, 4, 8] and m["max_batch"] == 8 and "stale" not in (m.get("ratios") or {})
    assert sorted(m["concurrency"]["nexrt"]["8k1k"]) == ["1", "4", "8"]
    by_c = m["ratios_by_conc"]["8k1k"]
    assert sorted(by_c) == ["4", "8"] and by_c["8"]["baseline"] == "vllm"
    assert by_c["4"]["interactivity_x"] == pytest.approx(2.98 / 1.06)
    assert m["nexrt_throughput_scaling"]["8k1k"]["output_tok_s_over_conc1"] == pytest.approx(3722 / 1200)
    assert os.path.getsize(str(tmp_path / "m_pareto.png")) > 1000
