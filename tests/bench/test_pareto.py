"""Pareto frontier and the overlay plot of several runs' agg files."""
import json

import pytest

from benchmarks.plot_pareto import main
from nexrt_vllm.bench.pareto import load_series, pareto_front


def test_frontier_keeps_points_not_beaten_on_both_axes():
    pts = [(10, 100), (20, 80), (15, 90), (12, 70), (20, 60), (30, 10), (5, 100)]
    # (12,70) is beaten by (15,90); (20,60) by (20,80); (5,100) by (10,100)
    assert pareto_front(pts) == [(10, 100), (15, 90), (20, 80), (30, 10)]
    assert pareto_front([(1, 1)]) == [(1, 1)]


def _agg(path, conc, intvty, tput):
    path.write_text(json.dumps({"conc": conc, "median_intvty": intvty, "tput_per_gpu": tput,
                                "output_tput_per_gpu": tput / 2}))
    return str(path)


def test_overlay_png_of_two_runs(tmp_path):
    for c, x, y in ((1, 300.0, 400.0), (4, 200.0, 1200.0)):
        _agg(tmp_path / f"agg_a_conc{c}.json", c, x, y)
        _agg(tmp_path / f"agg_b_conc{c}.json", c, x / 3, y * 0.8)
    out = tmp_path / "p.png"
    assert main(["--series", f"nexrt={tmp_path}/agg_a_*.json",
                 "--series", f"vllm={tmp_path}/agg_b_*.json", "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_bad_inputs(tmp_path, capsys):
    assert main(["--series", f"x={tmp_path}/none_*.json", "--out", str(tmp_path / "p.png")]) == 1
    assert "no agg_*.json files" in capsys.readouterr().err
    bad = tmp_path / "raw.json"
    bad.write_text(json.dumps({"median_tpot_ms": 3.0}))
    with pytest.raises(ValueError, match="not an InferenceX agg file"):
        load_series([str(bad)])
