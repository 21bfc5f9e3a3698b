"""The router is a light front: importing it (and building its app) must not pull torch or vLLM."""
import subprocess
import sys


def test_router_imports_neither_torch_nor_vllm():
    code = ("import sys; import nexrt_vllm.router.server as s; "
            "s.make_app(s.build_parser().parse_args("
            "['--vllm-url', 'http://x', '--decode-url', 'http://y'])); "
            "bad = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; "
            "print('LOADED', bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LOADED []" in r.stdout
