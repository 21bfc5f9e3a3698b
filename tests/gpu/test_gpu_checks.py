"""The GPU correctness checks as tests: each runs as a user runs it (`python -m benchmarks...` from the
repository root), writes its JSON, and must exit 0, i.e. no check it recorded failed
(nexrt_vllm.bench.checks). Marked `gpu`: skipped without a CUDA GPU (tests/conftest.py). On a GPU host:

    python -m pytest -m gpu tests/gpu/test_gpu_checks.py

Each JSON lands in the test's tmp dir, or under $NEXRT_CHECK_OUT/<test> when that is set (to keep it).
The trained tiny checkpoints are the stored ones (testing/stored.py), so nothing trains here."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from nexrt_vllm.testing.connector_harness import TRAINED, TRAINED_MTP

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(3600)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")


@pytest.fixture
def out(request, tmp_path):
    base = os.environ.get("NEXRT_CHECK_OUT")
    d = os.path.join(base, request.node.name) if base else str(tmp_path / "out")
    os.makedirs(d, exist_ok=True)
    return d


def checkpoints(tmp_path, **paths) -> str:
    """A dir of <family>/ links to the given checkpoints (the checks' --checkpoints)."""
    d = tmp_path / "ckpts"
    d.mkdir(exist_ok=True)
    for family, path in paths.items():
        os.symlink(path, d / family)
    return str(d)


def run_check(module: str, *args, timeout: float) -> int:
    p = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    sys.stdout.write(p.stdout[-6000:] + p.stderr[-6000:])
    return p.returncode


def assert_passed(rc: int, path: str) -> dict:
    with open(path) as f:
        report = json.load(f)
    failed = [name for name, ok in report.get("checks", {}).items() if not ok]
    assert rc == 0 and report["ok"] and not failed, f"exit {rc}, failed checks {failed} ({path})"
    return report


def test_gpu_check(out, tmp_path, ckpt_factory):
    """Kernel tests (PDL off / on), tiny-checkpoint and product-wiring parity, trained and FP8 parity
    (qwen3_next), the sampling graph."""
    ck = checkpoints(tmp_path, qwen3_next=ckpt_factory("qwen3_next", "bfloat16", **TRAINED))
    rc = run_check("benchmarks.checks.gpu_check", "--out", out, "--trained-parity", "--fp8", "--sampling",
                   "--checkpoints", ck, "--arches", "qwen3_next", timeout=3000)
    report = assert_passed(rc, os.path.join(out, "gpu_check.json"))
    assert {"kernel_tests", "kernel_tests_pdl", "trained_parity/qwen3_next", "fp8_parity/qwen3_next",
            "sampling"} <= set(report["checks"])


def test_gpu_check_speculative(out, tmp_path, ckpt_factory):
    """The captured MTP round == the eager one-token loop on the three families' trained MTP checkpoints."""
    ck = checkpoints(tmp_path, **{a: ckpt_factory(a, "bfloat16", **kw) for a, kw in TRAINED_MTP.items()})
    rc = run_check("benchmarks.checks.gpu_check", "--out", out, "--skip-tests", "--speculative",
                   "--checkpoints", ck, timeout=1800)
    report = assert_passed(rc, os.path.join(out, "gpu_check.json"))
    assert {f"spec_parity/{a}" for a in TRAINED_MTP} <= set(report["checks"])


@pytest.mark.parametrize("speculative", ["off", "mtp"])
def test_decode_bench(out, speculative):
    """The Qwen3.5-2B shape, random weights, 1K context: every shape runs; the eager ops in one graph
    give the eager engine's tokens (the fused kernels' tokens on random weights are reported only)."""
    path = os.path.join(out, f"decode_{speculative}.json")
    rc = run_check("benchmarks.decode_bench", "--shapes", "2b", "--contexts", "1024", "--steps", "20",
                   "--parity-steps", "32", "--eager-steps", "2", "--no-eager-controls", "--speculative", speculative,
                   "--json", path, timeout=1200)
    report = assert_passed(rc, path)
    assert report["shapes"] and "errors" not in report


def test_decode_bench_tp(out):
    """decode_bench --tp 2: the 2B shape on the TP graph path over two GPUs runs and reports its rows."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    path = os.path.join(out, "decode_tp2.json")
    rc = run_check("benchmarks.decode_bench", "--tp", "2", "--shapes", "2b", "--contexts", "1024", "--steps", "20",
                   "--parity-steps", "32", "--eager-steps", "2", "--json", path, timeout=1200)
    report = assert_passed(rc, path)
    assert report["tp"] == 2 and report["shapes"] and "errors" not in report
    assert report["shapes"][0]["contexts"][0]["tok_s"] > 0


def test_decode_bench_batch(out):
    """decode_bench --batch on the 2B shape (random weights, 1K context): a row per batch size (and the
    largest with one slot live), every step timed; the batch step's tokens are reported per slot."""
    path = os.path.join(out, "decode_batch.json")
    rc = run_check("benchmarks.decode_bench", "--shapes", "2b", "--contexts", "1024", "--steps", "20", "--batch",
                   "1,2,4", "--batch-parity-steps", "8", "--breakdown-ctx", "1024", "--json", path, timeout=1800)
    report = assert_passed(rc, path)
    rows = report["shapes"][0]["rows"]
    assert "errors" not in report and {(r["batch"], r["live"]) for r in rows} == {(1, 1), (2, 2), (4, 4), (4, 1)}
    assert all(r["step_ms"] > 0 and r["bytes_per_step"] > 0 for r in rows)
    assert set(report["shapes"][0]["parity"]) == {"2", "4"}


@needs_vllm
def test_gpu_parity(out, tmp_path, ckpt_factory):
    """vLLM-GPU prefill + the GPU decode node through the router == vLLM-only greedy, both transports; then an
    agent's three turns, the later ones shipping only what the node's context cache lacks."""
    ck = checkpoints(tmp_path, qwen3_next=ckpt_factory("qwen3_next", "bfloat16", **TRAINED))
    path = os.path.join(out, "gpu_parity.json")
    report = assert_passed(run_check("benchmarks.checks.gpu_parity", "--checkpoints", ck, "--families", "qwen3_next",
                                     "--turns", "3", "--json", path, timeout=2400), path)
    turns = [c for r in report["runs"] for c in r["cases"] if c["api"] == "completions-turn"]
    assert len(turns) == 3 * len(report["runs"]) and all(c["held_tokens"] > 0 for c in turns if c["turn"])


@needs_vllm
def test_gpu_layout_check(out, ckpt_factory):
    """The page layouts the connector detects on vLLM-GPU, against the engine's own prefill state."""
    path = os.path.join(out, "gpu_layouts.json")
    assert_passed(run_check("benchmarks.checks.gpu_layout_check", "--model",
                            ckpt_factory("qwen3_next", "bfloat16", **TRAINED), "--json", path, timeout=2400), path)


def test_tp_check(out):
    """The TP engine over NCCL against TP = 1 (greedy and after a re-sharded hand-off), TP = 2."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    path = os.path.join(out, "tp_check.json")
    assert_passed(run_check("benchmarks.checks.tp_check", "--tp", "2", "--json", path, timeout=900), path)
