"""The exit rule of the correctness checks (benchmarks/checks/, decode_bench.py): one rule for all.

A check records each claim it tests as a named pass / fail in its JSON report (`record`); `finish`
writes the report, with `"checks"` and an overall `"ok"`, and returns the process's exit status:
1 if any recorded check failed, else 0. The report is written either way, so a failed run keeps what
it measured.

    report = {...}
    record(report, "trained_parity/qwen3_5", r["equal"])
    return finish(report, path)          # main(): sys.exit(main())
"""
from __future__ import annotations

import json
import sys


def record(report: dict, name: str, ok) -> bool:
    """Record check `name` in `report["checks"]` as passed (`ok` truthy) or failed; returns it as a bool."""
    ok = bool(ok)
    report.setdefault("checks", {})[name] = ok
    return ok


def failed(report: dict) -> list[str]:
    """Names of the recorded checks that failed."""
    return [name for name, ok in report.get("checks", {}).items() if not ok]


def write(report: dict, path: str) -> list[str]:
    """Write `report` as JSON with `"ok"`: no recorded check failed. Returns the failed checks."""
    bad = failed(report)
    report["ok"] = not bad
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    return bad


def finish(report: dict, path: str) -> int:
    """Write `report` (`write`); 1, with the failed checks on stderr, if any recorded check failed, else 0."""
    bad = write(report, path)
    if bad:
        print(f"FAILED {len(bad)} of {len(report['checks'])} checks: {', '.join(bad)} (in {path})",
              file=sys.stderr, flush=True)
        return 1
    return 0
