"""The router is a light front: importing it (and building its app) must not pull torch or vLLM, nor
may the package root or anything of `nexrt_vllm.handoff` it imports. Each module is imported first
in a fresh interpreter, so an import cycle among them would fail here too."""
import subprocess
import sys

import pytest

HEAVY = ('torch', 'vllm', 'transformers')


def _heavy_loaded(code: str) -> None:
    code = f"import sys; {code}; bad = [m for m in {HEAVY!r} if m in sys.modules]; print('LOADED', bad)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LOADED []" in r.stdout, r.stdout


def test_router_imports_neither_torch_nor_vllm():
    _heavy_loaded("import nexrt_vllm.router.server as s; "
                  "s.make_app(s.build_parser().parse_args(['--vllm-url', 'http://x', '--decode-url', 'http://y']))")


@pytest.mark.parametrize("module", [
    "nexrt_vllm", "nexrt_vllm.router", "nexrt_vllm.handoff", "nexrt_vllm.handoff.contracts",
    "nexrt_vllm.handoff.protocol", "nexrt_vllm.handoff.layout", "nexrt_vllm.handoff.sharding",
    "nexrt_vllm.handoff.sender", "nexrt_vllm.handoff.transport",
    "nexrt_vllm.handoff.wire", "nexrt_vllm.launch",
])
def test_light_module_imports_neither_torch_nor_vllm(module):
    _heavy_loaded(f"import {module}")
