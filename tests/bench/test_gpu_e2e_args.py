"""gpu_e2e's refusals of flags that do not go together, before anything starts (exit 2 with the reason)."""
import pytest

from benchmarks.gpu_e2e import main


@pytest.mark.parametrize("argv,reason", [
    (["--paths", "vllm_mtp"], "needs --speculative mtp or --vllm-mtp"),
    (["--baseline-share", "1.5"], "--baseline-share: a fraction"),
    (["--share", "0"], "--share: a fraction"),
    (["--speculative", "mtp", "--vllm-mtp"], "--vllm-mtp is for a plain node"),
    (["--interleave", "--concurrent-baseline", "--paths", "nexrt", "vllm_mtp", "--speculative", "mtp"],
     "the paths nexrt and vllm"),
    (["--draft-weights", "fp8"], "--draft-weights is for --speculative mtp"),
    (["--speculative", "mtp", "--draft-weights", "fp4"], "--draft-weights: one of checkpoint, fp8, got 'fp4'"),
])
def test_refused(tmp_path, capsys, argv, reason):
    with pytest.raises(SystemExit) as e:
        main(["--tokenizer", str(tmp_path), "--out", str(tmp_path / "out"), *argv])
    assert e.value.code == 2 and reason in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything was written
