"""Throughput per GPU vs interactivity (InferenceX's Pareto chart), overlaying several runs
(benchmarks/plot_pareto.py is its CLI).

x = `median_intvty` (tok/s/user), y = `tput_per_gpu` (tok/s/GPU), one point per concurrency from
the `agg_*.json` files; each run's Pareto frontier (points not beaten on both axes) is drawn.
"""
from __future__ import annotations

import json

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
