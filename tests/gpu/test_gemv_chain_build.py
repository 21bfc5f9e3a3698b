"""csrc/gemv_chain.cu (the persistent GEMV chain, benchmarks/persistent_chain.py) builds for sm_90a
without spills, uses the bulk-copy / mbarrier instructions it is designed around, and the Python
launcher's ctypes records match the kernel's structs byte for byte (a host program compiled from the
same source prints their layout). CI has nvcc but no GPU: the kernel's results are checked on the
H200 by the benchmark itself (benchmarks/results/gpu/persistent_chain_h200.json)."""
import ctypes
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import persistent_chain as PC  # noqa: E402

try:
    NVCC = PC.nvcc()
except RuntimeError:
    NVCC = None

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not installed")

LAYOUT_MAIN = r'''
#include <cstddef>
#include <cstdio>
#include "gemv_chain.cu"
#define F(S, f) std::printf("%s.%s %zu\n", #S, #f, offsetof(S, f));
int main() {
  std::printf("Task %zu\nArgs %zu\n", sizeof(Task), sizeof(Args));
  F(Task, w) F(Task, x) F(Task, norm_w) F(Task, y) F(Task, n) F(Task, k) F(Task, prologue) F(Task, epilogue)
  F(Task, wait) F(Task, eps)
  F(Args, tasks) F(Args, counters) F(Args, epoch) F(Args, prof) F(Args, num_tasks) F(Args, stages) F(Args, stage_bytes)
  F(Args, max_k) F(Args, max_rows)
  return 0;
}
'''


@needs_nvcc
def test_kernel_builds_without_spills():
    cubin, report = PC.compile_cubin(16)
    assert cubin[:4] == b"\x7fELF"
    assert "gemv_chain_kernel" in report and "0 bytes spill stores, 0 bytes spill loads" in report, report
    ptx = subprocess.run([NVCC, "-ptx", "-std=c++17", "-gencode=arch=compute_90a,code=compute_90a", "-o", "-",
                          PC.SOURCE], capture_output=True, text=True, timeout=300, check=True).stdout
    for ins in ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", "mbarrier.try_wait.parity",
                "mbarrier.arrive.expect_tx", "ld.acquire.gpu", "bar.sync", "trap"):
        assert ins in ptx, ins


@needs_nvcc
def test_launcher_records_match_the_kernel_structs(tmp_path):
    src = tmp_path / "layout.cu"
    src.write_text(LAYOUT_MAIN)
    exe = tmp_path / "layout"
    subprocess.run([NVCC, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-I", os.path.join(ROOT, "csrc"),
                    "-o", str(exe), str(src)], check=True, capture_output=True, timeout=300)
    got = dict(line.rsplit(" ", 1) for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                              check=True, timeout=60).stdout.splitlines())
    for name, rec in (("Task", PC.Task), ("Args", PC.Args)):
        assert int(got[name]) == ctypes.sizeof(rec), name
        for field, _ in rec._fields_:
            assert int(got[f"{name}.{field}"]) == getattr(rec, field).offset, f"{name}.{field}"
