"""`import nexrt_vllm` stays light: only `nexrt_vllm.engine` brings torch in."""
import subprocess
import sys


def _loaded(stmt):
    code = f"import sys; {stmt}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def test_package_import_does_not_load_torch():
    assert _loaded("import nexrt_vllm") == "[]"


def test_bench_library_pure_parts_do_not_load_torch():
    """What a serving benchmark needs of nexrt_vllm.bench (shapes, the InferenceX client, the plot,
    the checks' exit rule) loads no torch; only the step / graft / MTP-round modules do."""
    stmt = ("import nexrt_vllm.bench, nexrt_vllm.bench.shapes, nexrt_vllm.bench.checks, nexrt_vllm.bench.inferencex, "
            "nexrt_vllm.bench.pareto")
    assert _loaded(stmt) == "[]"


def test_engine_import_loads_torch_but_not_transformers():
    assert _loaded("import nexrt_vllm.engine") == "['torch']"


def test_grammar_spec_is_pure_and_xgrammar_loads_only_for_grammars():
    """The router validates grammar specs with handoff.structured (no torch, no xgrammar); the
    engine imports xgrammar only when a grammar is compiled (engine.structured)."""
    code = ("import sys; import nexrt_vllm.handoff.structured as s; s.StructuredSpec('regex', 'a+').unsupported(); "
            "a = [m for m in ('torch', 'xgrammar', 'vllm') if m in sys.modules]; import nexrt_vllm.engine; "
            "b = [m for m in ('xgrammar', 'transformers') if m in sys.modules]; print(a, b)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[] []"
