"""Throughput per GPU vs interactivity (InferenceX's Pareto chart), overlaying several runs.

x = `median_intvty` (tok/s/user), y = `tput_per_gpu` (tok/s/GPU), one point per concurrency from
the `agg_*.json` files; each run's Pareto frontier (points not beaten on both axes) is drawn.

    python benchmarks/plot_pareto.py --series nexrt='res/nexrt/agg_*.json' \
        --series vllm='res/vllm/agg_*.json' --out pareto.png
"""
from __future__ import annotations

import argparse
import glob
import sys

from nexrt_vllm.bench.pareto import Y_KEY, load_series, plot_pareto


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot_pareto", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--series", action="append", required=True, metavar="LABEL=GLOB")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="")
    p.add_argument("--y", default=Y_KEY, choices=[Y_KEY, "output_tput_per_gpu"])
    a = p.parse_args(argv)
    try:
        series = {}
        for spec in a.series:
            label, sep, pattern = spec.partition("=")
            if not sep or not label:
                raise ValueError(f"--series {spec!r}: use LABEL=GLOB")
            series[label] = load_series(sorted(glob.glob(pattern)))
        plot_pareto(series, a.out, a.title, a.y)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
