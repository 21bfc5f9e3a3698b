"""Throughput per GPU vs interactivity (InferenceX's Pareto chart), overlaying several runs.

x = `median_intvty` (tok/s/user), y = `tput_per_gpu` (tok/s/GPU), one point per concurrency from
the `agg_*.json` files; each run's Pareto frontier (points not beaten on both axes) is drawn.

    python -m benchmarks.plot_pareto --series nexrt='res/nexrt/agg_*.json' \
        --series vllm='res/vllm/agg_*.json' --out pareto.png
"""
from __future__ import annotations

import argparse
import glob
import json
import sys

X_KEY = "median_intvty"
Y_KEY = "tput_per_gpu"


def load_series(paths: list[str]) -> list[dict]:
    if not paths:
        raise ValueError("no agg_*.json files for a series")
    series = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if data.get(X_KEY) is None or Y_KEY not in data:
            raise ValueError(f"{path}: not an InferenceX agg file (needs {X_KEY} and {Y_KEY})")
        series.append(data)
    return series


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points no other point beats on both axes (higher is better on both), sorted by x."""
    front, best_y = [], float("-inf")
    for x, y in sorted(set(points), key=lambda p: (-p[0], -p[1])):
        if y > best_y:
            front.append((x, y))
            best_y = y
    return sorted(front)


def plot_pareto(series: dict[str, list[dict]], out: str, title: str = "",
                y_key: str = Y_KEY) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for i, (label, aggs) in enumerate(series.items()):
        color = f"C{i}"
        pts = [(a[X_KEY], a[y_key]) for a in aggs]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, label=label, zorder=3)
        for a in aggs:
            ax.annotate(f"c{a['conc']}", (a[X_KEY], a[y_key]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8, color=color)
        front = pareto_front(pts)
        ax.plot([p[0] for p in front], [p[1] for p in front], color=color, alpha=0.7)
    ax.set_xlabel("Interactivity, median (tok/s/user)")
    ax.set_ylabel({"tput_per_gpu": "Token throughput per GPU (tok/s/GPU)",
                   "output_tput_per_gpu": "Output throughput per GPU (tok/s/GPU)"}.get(y_key, y_key))
    ax.set_title(title or "Throughput per GPU vs interactivity")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


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
