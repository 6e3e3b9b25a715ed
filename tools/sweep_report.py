"""Collect every job of a multirun into one table and plot.

    python tools/sweep_report.py <multirun dir> [--metric val/acc1] [--out <dir>]

Reads each job's ``summary.json`` and ``config.yaml``, groups jobs by attention variant and
activation ratio (mean and standard deviation over seeds), and writes ``sweep_report.md``,
``sweep_report.csv`` and ``sweep_report.png`` (metric against activation ratio and against
active GFLOPs; images/s too when measured).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List

import yaml


def load_jobs(root: Path) -> List[Dict[str, Any]]:
    jobs = []
    for summary_path in sorted(root.rglob("summary.json")):
        job_dir = summary_path.parent
        summary = json.loads(summary_path.read_text())
        cfg_path = job_dir / "config.yaml"
        cfg = yaml.safe_load(cfg_path.read_text()) if cfg_path.exists() else {}
        attention = (cfg.get("attention") or {})
        jobs.append({
            "dir": str(job_dir.relative_to(root)),
            "model": (cfg.get("model") or {}).get("name", summary.get("model")),
            "attention": attention.get("name") or "preset",
            "ratio": attention.get("activation_ratio") if attention.get("name") in ("moh", "moa") else 1.0,
            "seed": cfg.get("seed"),
            "summary": summary,
        })
    return jobs


def _stats(values: List[float]) -> Dict[str, float]:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return {"mean": float("nan"), "std": float("nan"), "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def aggregate(jobs: List[Dict[str, Any]], metrics: List[str]) -> List[Dict[str, Any]]:
    groups: Dict[tuple, List[Dict[str, Any]]] = defaultdict(list)
    for job in jobs:
        groups[(job["model"], job["attention"], job["ratio"])].append(job)
    rows = []
    for (model, attention, ratio), members in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]),
                                                                                     kv[0][2] or 0)):
        row = {"model": model, "attention": attention, "activation_ratio": ratio, "seeds": len(members)}
        for metric in metrics:
            st = _stats([m["summary"].get(metric) for m in members])
            row[f"{metric} mean"], row[f"{metric} std"] = st["mean"], st["std"]
        rows.append(row)
    return rows


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def write_markdown(rows: List[Dict[str, Any]], metrics: List[str], path: Path) -> str:
    headers = ["model", "attention", "activation_ratio", "seeds"] + [m for m in metrics]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        cells = [_fmt(r[h]) for h in headers[:4]]
        for m in metrics:
            mean, std = r[f"{m} mean"], r[f"{m} std"]
            cells.append(f"{_fmt(mean)} ± {_fmt(std)}" if r["seeds"] > 1 else _fmt(mean))
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def write_csv(rows: List[Dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def plot(rows: List[Dict[str, Any]], metric: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def measured(key: str) -> bool:
        return any(isinstance(r.get(f"{key} mean"), float) and not math.isnan(r[f"{key} mean"]) for r in rows)

    xs = [("activation_ratio", "activation ratio")]
    xs += [(key, label) for key, label in (("active_gflops", "active GFLOPs"), ("images_per_sec", "training images/s"))
           if measured(key)]
    fig, axes = plt.subplots(1, len(xs), figsize=(5 * len(xs), 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], xs):
        by_attention: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
        for r in rows:
            by_attention[f"{r['model']} / {r['attention']}"].append(r)
        for name, members in by_attention.items():
            x = [m["activation_ratio"] if key == "activation_ratio" else m[f"{key} mean"] for m in members]
            y = [m[f"{metric} mean"] for m in members]
            err = [m[f"{metric} std"] for m in members]
            order = sorted(range(len(x)), key=lambda i: x[i] if x[i] is not None else 0)
            ax.errorbar([x[i] for i in order], [y[i] for i in order], yerr=[err[i] for i in order], marker="o",
                        capsize=3, label=name)
        ax.set_xlabel(label)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, help="a multirun directory (searched recursively for summary.json)")
    parser.add_argument("--metric", default=None, help="metric to report (default: val/acc1, or sample/class_acc)")
    parser.add_argument("--extra", nargs="*", default=["active_gflops", "gflops", "params", "images_per_sec"],
                        help="further summary keys to aggregate")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: the multirun dir)")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        print(f"error: {args.root} is not a directory", file=sys.stderr)
        return 2
    jobs = load_jobs(args.root)
    if not jobs:
        print(f"error: no summary.json under {args.root} (did the jobs finish?)", file=sys.stderr)
        return 2
    metric = args.metric or ("val/acc1" if "val/acc1" in jobs[0]["summary"] else "sample/class_acc")
    metrics = [metric] + [m for m in args.extra if m != metric]
    rows = aggregate(jobs, metrics)
    out = args.out or args.root
    out.mkdir(parents=True, exist_ok=True)
    text = write_markdown(rows, metrics, out / "sweep_report.md")
    write_csv(rows, out / "sweep_report.csv")
    plot(rows, metric, out / "sweep_report.png")
    print(text)
    print(f"{len(jobs)} jobs -> {out / 'sweep_report.md'}, .csv, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
