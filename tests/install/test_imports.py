"""Every module of the package and of benchmarks/ imports in the environment scripts/setup.sh made.

A module that only some test imports, or none, would otherwise hide a missing install line until a
user runs it; collection already imports tests/ (a missing package fails there). One subprocess, so
the check stays cheap and sees a clean interpreter."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_IMPORT_ALL = r"""
import importlib, os, sys, traceback
root = sys.argv[1]
failed = []
count = 0
for top in ("nexrt_vllm", "benchmarks"):
    for d, dirs, files in os.walk(os.path.join(root, top), followlinks=True):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__" and not x.startswith("."))
        if "__init__.py" not in files:
            dirs[:] = []
            continue
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(d, f), root)[:-3].split(os.sep)
            name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
            count += 1
            try:
                importlib.import_module(name)
            except Exception:
                failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print(count)
print("\n".join(failed))
"""


def test_every_module_imports():
    r = subprocess.run([sys.executable, "-c", _IMPORT_ALL, ROOT], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    count, failed = int(lines[0]), [x for x in lines[1:] if x]
    assert count > 50, f"only {count} modules found under nexrt_vllm/ and benchmarks/"
    assert not failed, "modules that do not import:\n" + "\n".join(failed)
