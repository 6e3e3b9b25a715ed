"""One table and plot for every job of a multirun (``tools/sweep_report.py``).

Reads each job's ``summary.json`` and ``config.yaml`` and groups jobs into *arms*: jobs that differ only in their seed.
A job's arm is what its Hydra overrides set to values that vary across the sweep, the seed excepted
(``+experiment/compare=moh_50`` gives ``moh_50``, ``attention.activation_ratio=0.5`` gives ``activation_ratio=0.5``);
without Hydra's records, its model and full attention config. Per arm: mean and standard deviation over seeds of the
metric, active GFLOPs, GFLOPs, parameters and training images/s; the verdict against the reference arm (the dense one
unless ``reference=`` names another, :mod:`moh_vision.apps.comparison`) within ``margin`` (default 0.5, in the
metric's units: points of top-1); the runs that had not converged (from their ``metrics.csv``).
:func:`write_sweep_report` writes ``sweep_report.md``, ``.csv``, ``.json`` and ``.png`` (:func:`make_figure`)."""
from __future__ import annotations

import csv
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

from moh_vision.apps import comparison
from moh_vision.checkpoints import run_config
from moh_vision.errors import ConfigError

DEFAULT_EXTRA = ("active_gflops", "gflops", "params", "images_per_sec")
DEFAULT_MARGIN = 0.5     # points of top-1: an arm within +-0.5 of dense "keeps dense accuracy"
CONVERGE_TOL = 0.3       # best vs final value of a run
FLAT_TOL = 0.5           # rise of the trend over the last CONVERGE_WINDOW evaluations
CONVERGE_WINDOW = 5

SEED_KEYS = ("seed", "+seed", "++seed")
# a config group whose option names the arm (the comparison arms; "compare" in multiruns of earlier releases)
ARM_GROUP_KEYS = tuple(f"{plus}{group}" for group in ("experiment/compare", "compare") for plus in ("", "+", "++"))


def _overrides(job_dir: Path) -> Optional[Dict[str, str]]:
    """``key -> value`` of the Hydra overrides this job ran with (None if Hydra kept no record)."""
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    pairs = (str(item).partition("=") for item in yaml.safe_load(path.read_text()) or [])
    return {key: value for key, _, value in pairs}


def _config_signature(cfg: Dict[str, Any]) -> str:
    model = cfg.get("model") or {}
    attention = {k: v for k, v in (cfg.get("attention") or {}).items() if v is not None}
    return json.dumps({"model": model.get("name"), "kwargs": model.get("kwargs") or {}, "attention": attention},
                      sort_keys=True)


def load_jobs(root: Path) -> List[Dict[str, Any]]:
    jobs = []
    for summary_path in sorted(root.rglob("summary.json")):
        job_dir = summary_path.parent
        summary = json.loads(summary_path.read_text())
        try:
            cfg = run_config(job_dir)
        except ConfigError:  # a job without its config: grouped by its summary alone
            cfg = {}
        attention = cfg.get("attention") or {}
        jobs.append({
            "dir": str(job_dir.relative_to(root)),
            "model": (cfg.get("model") or {}).get("name") or summary.get("model"),
            "attention": attention.get("name") or "preset",
            "ratio": job_ratio(attention, summary),
            "seed": cfg.get("seed"),
            "overrides": _overrides(job_dir),
            "signature": _config_signature(cfg),
            "summary": summary,
        })
    assign_arms(jobs)
    return jobs


def job_ratio(attention: Dict[str, Any], summary: Dict[str, Any]) -> float:
    """A job's activation ratio: the one it asked for (any variant's ``activation_ratio``), else the active-head
    fraction its layers declared (``summary.json``: explicit heads, presets), else 1."""
    requested = attention.get("activation_ratio")
    if requested is not None and attention.get("topk") is None:  # explicit heads win over the ratio
        return float(requested)
    realised = summary.get("active_head_fraction")
    return round(float(realised), 4) if realised is not None else 1.0


def _short(key: str, value: str) -> str:
    return value if key in ARM_GROUP_KEYS else f"{key.lstrip('+').split('.')[-1]}={value}"


def assign_arms(jobs: List[Dict[str, Any]]) -> None:
    """Set ``job["arm"]``: the non-seed overrides that vary across the sweep, else the job's config. Labels made from
    configs may coincide for different configs (two MoH arms with explicit heads and no ratio): those get ``#1``,
    ``#2``, ... so that no two arms are ever merged."""
    recorded = [j["overrides"] for j in jobs if j["overrides"] is not None]
    keys = sorted({k for o in recorded for k in o})
    varying = [k for k in keys if k not in SEED_KEYS and len({o.get(k) for o in recorded}) > 1]
    for job in jobs:
        if varying and job["overrides"] is not None:
            job["arm"] = ",".join(_short(k, job["overrides"][k]) for k in varying if k in job["overrides"]) \
                or "(defaults)"
            job["arm_id"] = "overrides:" + job["arm"]
        else:
            ratio = f"@{job['ratio']}" if job["ratio"] != 1.0 else ""
            job["arm"] = f"{job['model']}/{job['attention']}{ratio}"
            job["arm_id"] = "config:" + job["signature"]
    ids_by_label: Dict[str, List[str]] = defaultdict(list)
    for job in jobs:
        if job["arm_id"] not in ids_by_label[job["arm"]]:
            ids_by_label[job["arm"]].append(job["arm_id"])
    for job in jobs:
        ids = ids_by_label[job["arm"]]
        if len(ids) > 1:
            job["arm"] = f"{job['arm']}#{ids.index(job['arm_id']) + 1}"


def _stats(values: List[float]) -> Dict[str, float]:
    """Mean, sample std and the half-width of the mean's 95% Student's t interval (nan below 2 values)."""
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return {"mean": float("nan"), "std": float("nan"), "ci95": float("nan"), "n": 0}
    n = len(values)
    std = statistics.stdev(values) if n > 1 else 0.0
    ci95 = float("nan")
    if n > 1:
        from scipy.stats import t  # scipy comes with scikit-learn (the digits)
        ci95 = float(t.ppf(0.975, n - 1)) * std / math.sqrt(n)
    return {"mean": statistics.fmean(values), "std": std, "ci95": ci95, "n": n}


def aggregate(jobs: List[Dict[str, Any]], metrics: List[str]) -> List[Dict[str, Any]]:
    groups: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
    for job in jobs:
        groups[job["arm"]].append(job)  # unique per arm_id (assign_arms)

    def order(item):
        arm, members = item
        first = members[0]
        return (str(first["model"]), str(first["attention"]), first["ratio"] if first["ratio"] is not None else 0, arm)

    rows = []
    for arm, members in sorted(groups.items(), key=order):
        first = members[0]
        ratios = {m["ratio"] for m in members}
        row = {"arm": arm, "model": first["model"], "attention": first["attention"],
               "activation_ratio": first["ratio"] if len(ratios) == 1 else None, "seeds": len(members),
               "seed_list": " ".join(str(m["seed"]) for m in sorted(members, key=lambda m: str(m["seed"])))}
        by_seed = sorted(members, key=lambda m: str(m["seed"]))
        for i, metric in enumerate(metrics):
            st = _stats([m["summary"].get(metric) for m in members])
            row[f"{metric} mean"], row[f"{metric} std"], row[f"{metric} ci95"] = st["mean"], st["std"], st["ci95"]
            if i == 0:  # the reported metric, seed by seed (a stalled seed shows here, not in the mean)
                row[f"{metric} per_seed"] = " / ".join(_fmt(m["summary"].get(metric)) for m in by_seed)
        rows.append(row)
    return rows


def add_convergence(jobs: List[Dict[str, Any]], root: Path, metric: str, tol: float = CONVERGE_TOL,
                    flat_tol: float = FLAT_TOL, window: int = CONVERGE_WINDOW) -> bool:
    """Set ``job["convergence"]`` (:func:`comparison.convergence` of the metric's per-evaluation values in the job's
    ``metrics.csv``; None when the file holds fewer than two values of it: one value has no history to judge, e.g.
    diffusion's sample metrics, computed once at the end). Returns whether any job had a history."""
    higher = comparison.higher_is_better(metric)
    found = False
    for job in jobs:
        job["convergence"] = None
        path = root / job["dir"] / "metrics.csv"
        if not path.is_file():
            continue
        with open(path, newline="") as f:
            history = comparison.history_from_rows(list(csv.DictReader(f)), metric)
        if len(history) >= 2:
            job["convergence"] = comparison.convergence(history, higher, tol, flat_tol, window)
            found = True
    return found


def add_verdicts(rows: List[Dict[str, Any]], jobs: List[Dict[str, Any]], metric: str,
                 margin: float = DEFAULT_MARGIN, reference: Optional[str] = None) -> Optional[str]:
    """Per row: the Welch difference of ``metric`` means against the reference arm (``vs_ref diff``, ``low``, ``high``
    of its 95% interval, ``dof``), the ``verdict`` for ``margin``, and ``converged`` ("k/n" runs at their plateau, or
    ""). Returns the reference arm (None: no dense arm found, no verdicts)."""
    values: Dict[str, List[float]] = defaultdict(list)
    for job in jobs:
        values[job["arm"]].append(job["summary"].get(metric))
    ref = comparison.reference_arm({r["arm"]: r["activation_ratio"] for r in rows}, reference)
    if reference and ref is None:
        arms = ", ".join(r["arm"] for r in rows)
        raise ConfigError(f"reference={reference} is not an arm of this sweep; arms: {arms}")
    higher = comparison.higher_is_better(metric)
    for row in rows:
        arm = row["arm"]
        members = [j for j in jobs if j["arm"] == arm and j.get("convergence") is not None]
        row["converged"] = f"{sum(j['convergence']['converged'] for j in members)}/{len(members)}" if members else ""
        diff = comparison.welch_difference(values[arm], values[ref]) if ref and arm != ref else None
        for key in ("diff", "low", "high", "dof"):
            row[f"vs_ref {key}"] = diff[key] if diff else float("nan")
        row["verdict"] = "reference" if arm == ref else \
            comparison.verdict(diff["diff"], diff["low"], diff["high"], margin, higher) if diff else ""
    return ref


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


HEADERS = ["arm", "model", "attention", "activation_ratio", "seeds"]


def write_markdown(rows: List[Dict[str, Any]], metrics: List[str], path: Path, reference: Optional[str] = None,
                   margin: float = DEFAULT_MARGIN, jobs: Sequence[Dict[str, Any]] = ()) -> str:
    """One row per arm: every metric as mean ± std over seeds; the first (reported) metric also with its 95% confidence
    interval, its value per seed, the difference against the reference arm and its verdict, and how many runs had
    converged. Below the table: the runs that had not."""
    main = metrics[0]
    has_verdict = reference is not None
    has_convergence = any(r.get("converged") for r in rows)
    headers = HEADERS + [f"{main} mean ± std", "95% CI", "per seed"]
    if has_verdict:
        headers += [f"Δ vs {reference} [95% CI, Welch]", f"verdict (margin {margin:g})"]
    if has_convergence:
        headers += ["converged"]
    headers += list(metrics[1:])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        cells = [_fmt(r[h]) for h in HEADERS]
        half = r[f"{main} ci95"]
        mean, std = r[f"{main} mean"], r[f"{main} std"]
        cells.append(f"{_fmt(mean)} ± {_fmt(std)}" if r["seeds"] > 1 else _fmt(mean))
        cells.append(f"[{_fmt(mean - half)}, {_fmt(mean + half)}]" if r["seeds"] > 1 else "")
        cells.append(r[f"{main} per_seed"])
        if has_verdict:
            diff = r["vs_ref diff"]
            cells.append("" if r["arm"] == reference else
                         f"{diff:+.3g} [{_fmt(r['vs_ref low'])}, {_fmt(r['vs_ref high'])}]" if _finite(diff) else "n/a")
            cells.append(r["verdict"])
        if has_convergence:
            cells.append(r.get("converged", ""))
        for m in metrics[1:]:
            mean, std = r[f"{m} mean"], r[f"{m} std"]
            cells.append(f"{_fmt(mean)} ± {_fmt(std)}" if r["seeds"] > 1 else _fmt(mean))
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if has_verdict:
        text += (f"\nΔ: mean of the arm minus mean of {reference}, 95% interval with Welch's degrees of freedom; "
                 f"within margin: the whole interval inside ±{margin:g}; better/worse by |Δ|: the whole interval "
                 f"beyond it; inconclusive: the interval straddles ±{margin:g}.\n")
    stalled = not_converged(jobs)
    if has_convergence:
        text += (f"\nConverged: best and final {main} within {CONVERGE_TOL:g} and the trend of the last "
                 f"{CONVERGE_WINDOW} evaluations within ±{FLAT_TOL:g}. ")
        checked = sum(j.get("convergence") is not None for j in jobs)
        text += ("Every run converged.\n" if not stalled else
                 f"NOT CONVERGED: {len(stalled)} of {checked} runs\n" + "".join(f"- {line}\n" for line in stalled))
    path.write_text(text)
    return text


def not_converged(jobs: Sequence[Dict[str, Any]]) -> List[str]:
    """One line per run whose metric had not reached its plateau."""
    out = []
    for job in jobs:
        c = job.get("convergence")
        if c is not None and not c["converged"]:
            out.append(f"{job['arm']} seed {job['seed']} ({job['dir']}): best {_fmt(c['best'])}, final "
                       f"{_fmt(c['final'])}, trend of the last evaluations {_fmt(c['trend'])}")
    return out


def write_json(rows: List[Dict[str, Any]], jobs: List[Dict[str, Any]], metric: str, settings: Dict[str, Any],
               path: Path) -> None:
    """Everything the report computed, for scripts: the settings, one entry per arm, one per job."""
    def plain(v: Any) -> Any:
        return None if isinstance(v, float) and math.isnan(v) else v

    data = {"metric": metric, **settings, "arms": [{k: plain(v) for k, v in r.items()} for r in rows],
            # the same by arm name, keys without spaces: what a doc's figure marker addresses (docs/bench/README.md)
            "by_arm": {r["arm"]: {k.replace(" ", "_"): plain(v) for k, v in r.items()} for r in rows},
            "jobs": [{"arm": j["arm"], "seed": j["seed"], "dir": j["dir"], metric: plain(j["summary"].get(metric)),
                      "convergence": {k: plain(v) for k, v in j["convergence"].items()} if j.get("convergence")
                      else None} for j in jobs]}
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_csv(rows: List[Dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not math.isnan(value)


# One colour per attention type in every panel (matplotlib's colour cycle would restart per panel, shifted by a family
# without points there) and one marker per model.
ATTENTION_COLORS = {"mha": "tab:blue", "moh": "tab:green", "moa": "tab:orange", "preset": "tab:purple"}
SPARE_COLORS = ("tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")
MODEL_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">")


def family_styles(rows: List[Dict[str, Any]]) -> Dict[str, Dict[str, str]]:
    """``"model / attention" -> {"color", "marker"}``: the colour follows the attention type, the marker the model."""
    attentions = sorted({str(r["attention"]) for r in rows})
    spare = iter(SPARE_COLORS * (1 + len(attentions) // len(SPARE_COLORS)))
    colors = {a: ATTENTION_COLORS.get(a) or next(spare) for a in attentions}
    models = sorted({str(r["model"]) for r in rows})
    markers = {m: MODEL_MARKERS[i % len(MODEL_MARKERS)] for i, m in enumerate(models)}
    return {f"{r['model']} / {r['attention']}": {"color": colors[str(r["attention"])],
                                                 "marker": markers[str(r["model"])]} for r in rows}


def make_figure(rows: List[Dict[str, Any]], metric: str, jobs: Sequence[Dict[str, Any]] = ()):
    """The report's figure: the metric against the activation ratio, active GFLOPs and images/s, one labelled point per
    arm with error bars of one standard deviation over seeds (colour: the attention type, marker: the model); with
    ``jobs``, every seed's own value as a small dot beside its arm's mean (a stalled seed shows)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    from matplotlib.transforms import ScaledTranslation

    def measured(key: str) -> bool:
        return any(_finite(r.get(f"{key} mean")) for r in rows)

    xs = [("activation_ratio", "activation ratio")]
    xs += [(key, label) for key, label in (("active_gflops", "active GFLOPs"), ("images_per_sec", "training images/s"))
           if measured(key)]
    styles = family_styles(rows)
    fig, axes = plt.subplots(1, len(xs), figsize=(5.5 * len(xs), 4.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], xs):
        by_family: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
        for r in rows:
            by_family[f"{r['model']} / {r['attention']}"].append(r)
        for family, members in by_family.items():
            x = [m["activation_ratio"] if key == "activation_ratio" else m[f"{key} mean"] for m in members]
            xerr = [0.0 if key == "activation_ratio" else m[f"{key} std"] for m in members]
            y = [m[f"{metric} mean"] for m in members]
            yerr = [m[f"{metric} std"] for m in members]
            keep = sorted((i for i in range(len(x)) if _finite(x[i]) and _finite(y[i])), key=lambda i: x[i])
            if not keep:
                continue
            style = styles[family]
            ax.errorbar([x[i] for i in keep], [y[i] for i in keep], yerr=[yerr[i] for i in keep],
                        xerr=[xerr[i] if _finite(xerr[i]) else 0.0 for i in keep], marker=style["marker"],
                        color=style["color"], capsize=3, linestyle="-" if len(keep) > 1 else "none", label=family)
            for i in keep:  # every point names its arm, so arms of one family are told apart
                ax.annotate(members[i]["arm"], (x[i], y[i]), textcoords="offset points", xytext=(4, 4), fontsize=7,
                            color=style["color"])
                seeds = [_seed_point(j, key, metric) for j in jobs if j["arm"] == members[i]["arm"]]
                seeds = [(sx if _finite(sx) else x[i], sy) for sx, sy in seeds if _finite(sy)]
                if seeds:  # drawn 7 points left of the error bar, so that the bar does not hide them
                    shift = ax.transData + ScaledTranslation(-7 / 72, 0, ax.figure.dpi_scale_trans)
                    ax.scatter([p[0] for p in seeds], [p[1] for p in seeds], s=14, color=style["color"], alpha=0.6,
                               marker=style["marker"], linewidths=0, zorder=3, label="_seeds", transform=shift)
                    ax.update_datalim(seeds)  # a shifted artist does not widen the axes by itself
                    ax.autoscale_view()
        # few ticks, plain numbers without an offset, slanted: long values (0.004012, 12345) never collide
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4, min_n_ticks=2))
        ax.ticklabel_format(axis="x", style="plain", useOffset=False)
        for tick in ax.get_xticklabels():
            tick.set_rotation(30)
            tick.set_horizontalalignment("right")
        ax.set_xlabel(label)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    handles = {}
    for ax in axes[0]:  # one legend for every family, wherever it was plotted
        for handle, name in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(name, handle)
    if handles:
        axes[0][-1].legend(list(handles.values()), list(handles), fontsize=8)
    seeds = " (dots: each seed)" if jobs else ""
    fig.suptitle(f"{metric}: mean ± std over seeds, one point per arm{seeds}", fontsize=10)
    fig.tight_layout()
    return fig


def _seed_point(job: Dict[str, Any], key: str, metric: str):
    """One job's (x, y) in the panel of ``key``: its own active GFLOPs / images/s, its arm's ratio."""
    x = job["ratio"] if key == "activation_ratio" else job["summary"].get(key)
    y = job["summary"].get(metric)
    return (float(x) if _finite(x) else float("nan")), (float(y) if _finite(y) else float("nan"))


def plot(rows: List[Dict[str, Any]], metric: str, path: Path, jobs: Sequence[Dict[str, Any]] = ()) -> None:
    import matplotlib.pyplot as plt
    fig = make_figure(rows, metric, jobs)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def default_metric(jobs: Sequence[Dict[str, Any]]) -> str:
    """``val_ema/acc1`` when every job evaluated an EMA of its weights (``trainer.ema.enabled``: the smoother of the two
    curves, what a recipe with an EMA is judged by), else ``val/acc1``; ``sample/class_acc`` for diffusion sweeps."""
    for metric in ("val_ema/acc1", "val/acc1"):
        if all(metric in job["summary"] for job in jobs):
            return metric
    return "sample/class_acc"


def write_sweep_report(root: Path, metric: Optional[str] = None, extra: Sequence[str] = DEFAULT_EXTRA,
                       out: Optional[Path] = None, margin: float = DEFAULT_MARGIN,
                       reference: Optional[str] = None) -> List[Dict[str, Any]]:
    """Report the jobs under ``root`` (searched recursively for ``summary.json``) into ``out`` (default ``root``):
    ``metric`` (default: :func:`default_metric`) and the ``extra`` summary keys, per arm, each arm against ``reference``
    (default: the dense arm) with ``margin``, and every run's convergence. Prints the table and returns its rows."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory")
    jobs = load_jobs(root)
    if not jobs:
        raise ConfigError(f"no summary.json under {root} (did the jobs finish?)")
    metric = metric or default_metric(jobs)
    # the other sample metrics of a diffusion sweep (sample/fd_digits beside sample/class_acc) come along
    group = metric.split("/", 1)[0] + "/" if metric.startswith("sample/") else None
    siblings = sorted({k for j in jobs for k in j["summary"] if group and k.startswith(group) and k != metric})
    metrics = list(dict.fromkeys([metric, *siblings, *extra]))
    rows = aggregate(jobs, metrics)
    add_convergence(jobs, root, metric)
    ref = add_verdicts(rows, jobs, metric, margin, reference)
    out = Path(out) if out else root
    out.mkdir(parents=True, exist_ok=True)
    text = write_markdown(rows, metrics, out / "sweep_report.md", ref, margin, jobs)
    write_csv(rows, out / "sweep_report.csv")
    settings = {"reference": ref, "margin": margin, "higher_is_better": comparison.higher_is_better(metric),
                "converge_tol": CONVERGE_TOL, "flat_tol": FLAT_TOL, "converge_window": CONVERGE_WINDOW}
    write_json(rows, jobs, metric, settings, out / "sweep_report.json")
    plot(rows, metric, out / "sweep_report.png", jobs)
    print(text)
    print(f"{len(jobs)} jobs in {len(rows)} arms -> {out / 'sweep_report.md'}, .csv, .json, .png")
    return rows
