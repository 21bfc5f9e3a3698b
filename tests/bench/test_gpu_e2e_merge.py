"""gpu_e2e's `merge` of runs on one GPU that measured different paths: what the node served with (its flags, the
MTP head's format, its tuning) comes from the run that measured the NexRT path, whatever the files' order."""
import json

from benchmarks.gpu_e2e import merge


def test_merge_takes_the_node_flags_from_the_run_that_measured_the_node(tmp_path):
    """Merged runs say what the node served with (its flags, MTP head format, tuning) from the run that measured
    the NexRT path, also when a baselines-only run, which records other flags, comes first."""
    def run(name, path, **kw):
        r = {"command": f"gpu_e2e {path}", "shape": "Qwen3.5-2B", "layers": 24, "interleaved": False, "nexrt": {},
             "vllm": {}, "vllm_mtp": {}, "node": {}, **kw}
        tpot = 0.56 if path == "nexrt" else 0.97
        r[path] = {"8k1k": {"median_tpot_ms": tpot, "median_ttft_ms": 86.0, "median_e2el_ms": 1000.0 + tpot,
                            "output_throughput": 1530.0, "median_interactivity_tok_s": 1e3 / tpot}}
        p = tmp_path / name
        p.write_text(json.dumps(r))
        return str(p)

    base = run("base.json", "vllm_mtp", draft_weights="checkpoint", node_speculative_flags=["--speculative", "mtp"])
    node = run("node.json", "nexrt", draft_weights="fp8", node_tuning="gdn_recommit=1",
               node_speculative_flags=["--speculative", "mtp", "--draft-weights", "fp8"])
    out = str(tmp_path / "m.json")
    assert merge([base, node], out, None) == 0
    m = json.load(open(out))
    assert m["draft_weights"] == "fp8" and m["node_tuning"] == "gdn_recommit=1"
    assert m["node_speculative_flags"][-2:] == ["--draft-weights", "fp8"]
    assert m["ratios"]["8k1k"]["interactivity_x"] > 1
