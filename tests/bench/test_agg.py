"""agg_*.json as InferenceX's process_result.py writes it: units, intvty keys, per-GPU throughputs."""
import json

import pytest

from benchmarks.inferencex import main
from nexrt_vllm.bench.inferencex import BenchmarkError, Identity, make_agg

RAW = {
    "date": "20261129-120000", "backend": "openai-chat", "model_id": "tiny", "tokenizer_id": "t",
    "best_of": 1, "num_prompts": 16, "request_rate": "inf", "burstiness": 1.0,
    "max_concurrency": 4, "duration": 8.0, "completed": 16, "total_input_tokens": 16000,
    "total_output_tokens": 4000, "request_throughput": 2.0, "request_goodput:": None,
    "output_throughput": 500.0, "total_token_throughput": 2500.0,
    "input_lens": [1000] * 16, "output_lens": [250] * 16,
    "mean_ttft_ms": 250.0, "median_ttft_ms": 200.0, "std_ttft_ms": 10.0, "p90_ttft_ms": 300.0,
    "p99_ttft_ms": 400.0, "p99.9_ttft_ms": 450.0,
    "mean_tpot_ms": 4.0, "median_tpot_ms": 5.0, "std_tpot_ms": 0.0, "p90_tpot_ms": 8.0,
    "p99_tpot_ms": 10.0, "p99.9_tpot_ms": 12.5,
    "mean_itl_ms": 4.0, "median_itl_ms": 4.0, "std_itl_ms": 1.0, "p90_itl_ms": 6.0,
    "p99_itl_ms": 9.0, "p99.9_itl_ms": 11.0,
    "mean_e2el_ms": 1250.0, "median_e2el_ms": 1200.0, "std_e2el_ms": 50.0, "p90_e2el_ms": 1300.0,
    "p99_e2el_ms": 1400.0, "p99.9_e2el_ms": 1500.0,
}


def test_single_node_fields_and_units():
    agg = make_agg(RAW, Identity(hw="h200", framework="vllm", precision="fp8", tp=2, pp=2),
                   isl=1024, osl=256)
    assert agg["conc"] == 4 and agg["model"] == "tiny" and agg["isl"] == 1024 and agg["osl"] == 256
    assert agg["disagg"] is False and agg["is_multinode"] is False
    assert (agg["tp"], agg["pp"], agg["ep"], agg["dp_attention"]) == (2, 2, 1, "false")
    # 4 GPUs (tp * pp * pcp)
    assert agg["tput_per_gpu"] == pytest.approx(625.0)
    assert agg["output_tput_per_gpu"] == pytest.approx(125.0)
    assert agg["input_tput_per_gpu"] == pytest.approx(500.0)
    # every *_ms -> seconds without _ms
    assert agg["median_ttft"] == pytest.approx(0.2)
    assert agg["p99.9_e2el"] == pytest.approx(1.5)
    assert agg["mean_itl"] == pytest.approx(0.004)
    assert agg["median_tpot"] == pytest.approx(0.005)
    # every *tpot* -> *intvty* = 1000 / ms (tok/s/user)
    assert agg["median_intvty"] == pytest.approx(200.0)
    assert agg["mean_intvty"] == pytest.approx(250.0)
    assert agg["p99.9_intvty"] == pytest.approx(80.0)
    assert agg["std_intvty"] is None            # upstream would divide by zero here
    assert "router" not in agg and "kv_p2p_transfer" not in agg
    assert not any(k.endswith("_ms") for k in agg)
    json.dumps(agg, allow_nan=False)


def test_disaggregated_per_gpu_split():
    ident = Identity(prefill_gpus=2, decode_gpus=1, router={"name": "nexrt-router",
                                                            "version": "0.1.0"},
                     kv_p2p_transfer="mooncake")
    agg = make_agg(RAW, ident, isl=1024, osl=256)
    assert agg["disagg"] is True and agg["is_multinode"] is True
    assert agg["num_prefill_gpu"] == 2 and agg["num_decode_gpu"] == 1
    assert agg["prefill_tp"] == 2 and agg["decode_tp"] == 1
    assert agg["tput_per_gpu"] == pytest.approx(2500.0 / 3)        # total / (P + D)
    assert agg["output_tput_per_gpu"] == pytest.approx(500.0)      # output / D
    assert agg["input_tput_per_gpu"] == pytest.approx(1000.0)      # (total - output) / P
    assert agg["router"] == {"name": "nexrt-router", "version": "0.1.0"}
    assert agg["kv_p2p_transfer"] == "mooncake"


def test_bad_identity_is_refused():
    with pytest.raises(BenchmarkError, match="tp, pp"):
        make_agg(RAW, Identity(tp=0), 1, 1)
    with pytest.raises(BenchmarkError, match="router metadata"):
        make_agg(RAW, Identity(router={"name": "x", "version": ""}), 1, 1)


def test_agg_command_converts_a_foreign_raw_file(tmp_path, capsys):
    raw = tmp_path / "vllm_bench.json"
    raw.write_text(json.dumps(RAW))
    assert main(["agg", str(raw), "--isl", "1024", "--osl", "256", "--tp", "8"]) == 0
    agg = json.loads((tmp_path / "agg_vllm_bench.json").read_text())
    assert agg["tput_per_gpu"] == pytest.approx(2500.0 / 8)
    bad = tmp_path / "other.json"
    bad.write_text("{}")
    assert main(["agg", str(bad), "--isl", "1", "--osl", "1"]) == 1
    assert "not a benchmark_serving result" in capsys.readouterr().err
    assert main(["agg", str(raw), "--isl", "1", "--osl", "1", "--decode-gpus", "1"]) == 1
    assert "--decode-gpus needs --prefill-gpus" in capsys.readouterr().err
