"""The statistics behind a comparison's verdict (``tools/sweep_report.py``): each arm against a reference arm (the dense
one) by Welch's difference of means (:func:`welch_difference`: the arms' variances are not assumed equal) read against
an equivalence margin (:func:`verdict`: an interval that straddles the margin is inconclusive, more seeds would decide
it), and whether each run had converged (:func:`convergence`)."""
from __future__ import annotations

import math
import statistics
from typing import Any, Dict, Optional, Sequence

# Metrics where lower is better (a name containing one of these); every other metric is higher-better.
LOWER_IS_BETTER = ("loss", "fd", "fid", "error", "err")


def higher_is_better(metric: str) -> bool:
    """``val/acc1`` -> True; ``val/loss``, ``sample/fd_digits``, ``fid`` -> False."""
    words = metric.lower().replace("/", "_").split("_")
    return not any(w in LOWER_IS_BETTER for w in words)


def _clean(values: Sequence[Any]) -> list:
    return [float(v) for v in values if isinstance(v, (int, float)) and not math.isnan(float(v))]


def welch_difference(arm: Sequence[float], reference: Sequence[float], confidence: float = 0.95) -> Dict[str, float]:
    """``diff = mean(arm) - mean(reference)``, its standard error ``se = sqrt(s_a^2/n_a + s_r^2/n_r)``, the
    Welch-Satterthwaite degrees of freedom ``dof = se^4 / ((s_a^2/n_a)^2/(n_a-1) + (s_r^2/n_r)^2/(n_r-1))`` and the
    interval ``diff -+ t_{(1+confidence)/2, dof} * se`` (``low``, ``high``). Fewer than two values on either side: no
    interval (nan); both arms without spread (``se == 0``): the interval ``[diff, diff]``, ``dof`` nan."""
    a, r = _clean(arm), _clean(reference)
    nan = float("nan")
    out = {"diff": nan, "se": nan, "dof": nan, "low": nan, "high": nan, "n": len(a), "n_ref": len(r)}
    if not a or not r:
        return out
    out["diff"] = diff = statistics.fmean(a) - statistics.fmean(r)
    if len(a) < 2 or len(r) < 2:
        return out
    va, vr = statistics.variance(a) / len(a), statistics.variance(r) / len(r)
    out["se"] = se = math.sqrt(va + vr)
    if se == 0.0:
        out["low"] = out["high"] = diff
        return out
    dof = (va + vr) ** 2 / (va ** 2 / (len(a) - 1) + vr ** 2 / (len(r) - 1))
    from scipy.stats import t  # scipy comes with scikit-learn (the digits)
    half = float(t.ppf(0.5 + confidence / 2, dof)) * se
    out.update(dof=dof, low=diff - half, high=diff + half)
    return out


def verdict(diff: float, low: float, high: float, margin: float, higher_better: bool = True) -> str:
    """The interval ``[low, high]`` of ``diff = arm - reference`` against the margin: ``within margin``,
    ``better by |diff|`` / ``worse by |diff|`` (the whole interval beyond ``+margin`` or ``-margin``), ``inconclusive``
    (the interval straddles ``-margin`` or ``+margin``), or ``n/a`` (no interval)."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return "n/a"
    if -margin <= low and high <= margin:
        return "within margin"
    if low > margin or high < -margin:
        better = (low > margin) == higher_better
        return f"{'better' if better else 'worse'} by {abs(diff):.3g}"
    return "inconclusive"


def convergence(history: Sequence[float], higher_better: bool = True, tol: float = 0.3, flat_tol: float = 0.5,
                window: int = 5) -> Dict[str, Any]:
    """Whether one run's metric had reached its plateau, from its values per evaluation (oldest first).

    ``gap``: how far the final value is from the best one (>= 0); ``trend``: the rise of the least-squares line through
    the last ``window`` values (its slope times ``window - 1``; positive = still improving for a higher-better metric).
    Converged when ``gap <= tol`` and ``|trend| <= flat_tol``; fewer than ``window`` values: no trend, not converged."""
    values = _clean(history)
    nan = float("nan")
    if not values:
        return {"best": nan, "final": nan, "gap": nan, "trend": nan, "evaluations": 0, "converged": False}
    best = max(values) if higher_better else min(values)
    final = values[-1]
    gap = abs(best - final)
    trend = nan
    if len(values) >= window >= 2:
        ys = values[-window:]
        xbar, ybar = (window - 1) / 2, statistics.fmean(ys)
        slope = sum((i - xbar) * (y - ybar) for i, y in enumerate(ys)) / sum((i - xbar) ** 2 for i in range(window))
        trend = slope * (window - 1)
    converged = gap <= tol + 1e-9 and math.isfinite(trend) and abs(trend) <= flat_tol + 1e-9
    return {"best": best, "final": final, "gap": gap, "trend": trend, "evaluations": len(values),
            "converged": bool(converged)}


def history_from_rows(rows: Sequence[Dict[str, str]], metric: str) -> list:
    """A metric's values per evaluation from ``metrics.csv`` rows (as ``csv.DictReader`` gives them): the rows that
    carry it, in step order, the evaluation before training (``epoch`` < 0) left out."""
    return [float(row[metric]) for row in rows if row.get(metric) not in (None, "")
            and (row.get("epoch") in (None, "") or float(row["epoch"]) >= 0)]


def reference_arm(arms: Dict[str, float], requested: Optional[str] = None) -> Optional[str]:
    """The arm the others are compared with: ``requested`` if given (it must be one of ``arms``), else the one arm whose
    activation ratio is 1.0 (every head: the dense arm), else None. ``arms``: arm -> ratio."""
    if requested:
        return requested if requested in arms else None
    dense = [arm for arm, ratio in arms.items() if ratio is not None and float(ratio) == 1.0]
    return dense[0] if len(dense) == 1 else None
