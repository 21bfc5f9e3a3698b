"""A normal (non-editable) install carries the connector and the router, and a source checkout
imports the same package names: `nexrt_vllm.connector` is what vLLM loads as
kv_connector_module_path, from wherever it is started."""
import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = ("import nexrt_vllm, nexrt_vllm.connector.config, nexrt_vllm.router.params, nexrt_vllm.router.parsing; "
         "print(nexrt_vllm.connector.config.__file__)")


def test_wheel_carries_every_deployable_and_imports_from_anywhere(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "dist"), ROOT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = list((tmp_path / "dist").glob("nexrt_vllm-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("nexrt_vllm/connector/connector.py", "nexrt_vllm/router/server.py",
              "nexrt_vllm/router/parsing/__init__.py", "nexrt_vllm/node/server.py", "nexrt_vllm/launch.py",
              "nexrt_vllm/engine/gpu/runner.py", "nexrt_vllm/engine/spec/synthetic.py", "nexrt_vllm/bench/checks.py"):
        assert f in names, f
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(site)}
    # installed copy, started outside the checkout
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().startswith(str(site))
    # started from the repo root: the source tree shadows the install and still has every part
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert os.path.realpath(r.stdout.strip()) == os.path.join(ROOT, "connector", "config.py")
