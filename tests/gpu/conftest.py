"""Fixtures of the GPU-path tests."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def compile_sm90():
    """Run a kernel-compiling script (it prints one JSON line last) in a process of its own, outside the
    Triton interpreter the CPU tests switch on; its parsed JSON."""
    def run(script: str):
        env = dict(os.environ, PYTHONPATH=ROOT)
        env.pop("TRITON_INTERPRET", None)
        p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
        return json.loads(p.stdout.strip().splitlines()[-1])
    return run
