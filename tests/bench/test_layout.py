"""benchmarks/ imports nothing of itself and edits no sys.path: what benchmarks share is the installed
library nexrt_vllm.bench, so each runs as `python benchmarks/X.py` and `python -m benchmarks.X`."""
import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(p for p in glob.glob(os.path.join(ROOT, "benchmarks", "**", "*.py"), recursive=True)
                 if os.path.basename(p) != "__init__.py")
NAMES = {os.path.splitext(os.path.basename(p))[0] for p in SCRIPTS}


def test_benchmarks_import_only_the_library_and_edit_no_path():
    assert len(SCRIPTS) >= 10
    bad = []
    for path in SCRIPTS:
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            for m in mods:
                if m.split(".")[0] in {"benchmarks", "tests"} | NAMES:
                    bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} imports {m}")
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} uses sys.path")
    assert not bad, bad
