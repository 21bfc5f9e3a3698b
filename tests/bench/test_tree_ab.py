"""benchmarks/tools/tree_ab.py: one command against several source trees, alternated, one process per run."""
import json
import os

from benchmarks.tools import tree_ab

# a stand-in for decode_bench in each tree: its step time is the tree's own number (the file STEP), and it
# appends its tree and pid to a shared log, so the test sees the order and that every run is its own process
SCRIPT = '''
import json, os, sys
root = os.getcwd()
step = float(open(os.path.join(root, "STEP")).read())
with open(os.environ["AB_LOG"], "a") as f:
    f.write(f"{os.path.basename(root)} {os.getpid()}\\n")
if step < 0:
    sys.exit("this tree fails")
out = sys.argv[sys.argv.index("--json") + 1]
json.dump({"shapes": [{"shape": "Qwen3.5-2B", "dtype": "bf16", "draft_weights": "fp8",
                       "contexts": [{"context": 8192, "step_ms": step, "round_ms": 2 * step}]}]}, open(out, "w"))
'''


def _tree(tmp_path, name, step):
    root = tmp_path / name
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "fake_bench.py").write_text(SCRIPT)
    (root / "STEP").write_text(str(step))
    return f"{name}={root}"


def test_runs_alternate_each_in_its_own_process_and_the_summary_compares(tmp_path, monkeypatch):
    log = tmp_path / "order.log"
    monkeypatch.setenv("AB_LOG", str(log))
    out = tmp_path / "out" / "ab.json"
    rc = tree_ab.main(["--tree", _tree(tmp_path, "old", 2.0), "--tree", _tree(tmp_path, "new", 1.5), "--reps", "3",
                       "--out", str(out), "--", "benchmarks/fake_bench.py", "--steps", "100"])
    assert rc == 0
    order = [line.split() for line in log.read_text().splitlines()]
    assert [t for t, _ in order] == ["old", "new"] * 3
    assert len({pid for _, pid in order}) == 6
    r = json.loads(out.read_text())
    assert r["command"] == "benchmarks/fake_bench.py --steps 100" and r["reps"] == 3 and len(r["runs"]) == 6
    label = "Qwen3.5-2B/bf16/fp8/ctx8192"
    assert r["median"]["old"][label] == {"step_ms": 2.0, "round_ms": 4.0}
    assert r["ratio_to_old"]["new"][label] == {"step_ms": 0.75, "round_ms": 0.75}


def test_a_failing_run_is_reported_and_fails_the_call(tmp_path, monkeypatch):
    monkeypatch.setenv("AB_LOG", str(tmp_path / "order.log"))
    out = tmp_path / "ab.json"
    rc = tree_ab.main(["--tree", _tree(tmp_path, "a", 1.0), "--tree", _tree(tmp_path, "b", -1), "--reps", "1",
                       "--out", str(out), "--", "benchmarks/fake_bench.py"])
    assert rc == 1
    runs = {x["tree"]: x for x in json.loads(out.read_text())["runs"]}
    assert runs["a"]["rc"] == 0 and "log_tail" not in runs["a"]
    assert runs["b"]["rc"] != 0 and "this tree fails" in runs["b"]["log_tail"] and runs["b"]["rows"] == {}


def test_bad_arguments_are_refused_before_any_run(tmp_path, capsys):
    good = _tree(tmp_path, "a", 1.0)
    for argv, want in (([good, "--tree", good], "distinct"),
                       ([good, "--tree", "nodir"], "NAME=DIR"),
                       ([good, "--tree", f"b={tmp_path / 'missing'}"], "does not exist")):
        try:
            tree_ab.main(["--tree", *argv, "--out", str(tmp_path / "x.json"), "--", "benchmarks/fake_bench.py"])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(argv)
        assert want in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.json")
