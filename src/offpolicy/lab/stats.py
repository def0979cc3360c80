"""The lab's numbers: per-run statistics, their median and spread over seeds, and the verdicts.

Definitions (the report prints the same text; tests check them against hand-computed values):

* **quarters** — a run of N logged steps has q = max(1, ⌊N/4⌋); "first quarter" = its first q steps, "last quarter"
  = its last q steps; a reward "first ¼ / last ¼" is the mean of ``reward/mean`` over those steps.
* **mismatch** — ``rollout_correction/k3_kl`` (k3 = E_μ[ρ − 1 − log ρ], ρ = π_old/μ: ≥ 0, unlike the signed
  k1 = E_μ[log μ − log π], which the lab never reports alone), its median over the run's steps; the exact token KL
  ``mismatch/token_kl_exact_mean`` where the preset computes it (TRM); the PPL gap
  ``rollout_correction/log_ppl_abs_diff`` = |log PPL_trainer − log PPL_rollout|, its median over steps.
* **gradient norm** — ``loss/grad_norm`` (before clipping) per step: its median, 95th percentile (linear
  interpolation between order statistics, numpy's default) and maximum over the run.
* **masked fraction / length** — the mean over steps of ``correction/masked_frac`` and ``response/length_mean``.
* **spread over seeds** — every per-run number is summarised over the seeds of one preset × mismatch as
  median [min–max] (with 3 seeds an interquartile range would just be two of the three values).
* **mismatch trend** — per run, the least-squares slope b of ln(max(k3, 1e-10)) against the step (k3 below 1e-10 is
  fp32 rounding, |Δ log p| ≲ 1e-5); the fitted change over the run is ×exp(b · (last step − first step)).
  *growing*: b > 0 in every seed and the median fitted change ≥ ×2; *falling*: b < 0 in every seed and the median
  change ≤ ×0.5; otherwise *flat*. The mismatch is called **bounded** unless it is *growing*.
* **comparisons** — every measure of :data:`COMPARED` (reward first ¼, reward last ¼, reward drawdown, ‖∇‖ max,
  k3 KL) of a preset × mismatch against (a) naive under the same mismatch and (b) the same preset under the ``none``
  control (fp32 engine), one rule for all: Δ = difference of the medians over seeds. It is **within noise** when the
  two min–max ranges over seeds overlap (max of the minima ≤ min of the maxima); otherwise *higher* / *lower*. If the
  two settings did not differ at all, ranges of n and m seeds fail to overlap by chance with probability
  2 / C(n + m, n) (3 vs 3 seeds: 2/20 = 10 %), which the report prints beside each verdict. With fewer than 2 seeds
  on a side no verdict is given. The p is per comparison: among the several a table makes, one separates by chance
  more often than p (the report says so beside the list of separated ones).
* **paired comparisons** — a setting may pair the runs by seed instead (``"rule": "paired"`` in
  :mod:`offpolicy.lab.settings`; the demo's ``quick`` does): the same seed draws the same prompts, and until an
  engine's first sync the same samples, so much of the spread over seeds is shared by the two groups. Each measure is
  compared seed by seed over the seeds both groups ran: **higher** / **lower** when the difference has the same
  sign in every seed, **within noise** when the seeds disagree or one ties; Δ = the median of the per-seed
  differences. If the two settings did not differ, each difference would be positive or negative with probability ½
  independently, and all n agree by chance with probability 2 / 2ⁿ (6 seeds: 2/64 ≈ 3 %).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from offpolicy.lab.mismatch import CONTROL

RULES = ("ranges", "paired")  # how two groups are compared (module docstring): min–max ranges, or seed by seed

REQUIRED = ("reward/mean", "rollout_correction/k3_kl", "loss/grad_norm", "correction/masked_frac")
OPTIONAL = ("rollout_correction/log_ppl_abs_diff", "mismatch/token_kl_exact_mean", "response/length_mean",
            "time/step_s")
K3_FLOOR = 1e-10
GROWTH = 2.0  # the fitted change over the run that counts as growing (and 1/GROWTH as falling)

# the per-run numbers summarised over seeds, in table order
DRAWDOWN_WINDOW = 3  # steps of the trailing mean whose falls count as a drawdown (one step's batch noise averaged)

# the per-run measures every group is compared on (against naive and against the control), in table order:
# (field, name in the tables, +1 if higher is better / −1 if lower is better)
COMPARED: tuple[tuple[str, str, int], ...] = (
    ("reward_first", "reward first ¼", +1),
    ("reward_last", "reward last ¼", +1),
    ("reward_drawdown", "reward drawdown", -1),
    ("grad_norm_max", "‖∇‖ max", -1),
    ("k3_median", "k3 KL", -1),
)

RUN_FIELDS = ("reward_first", "reward_last", "reward_gain", "reward_drawdown", "k3_median", "exact_kl_median", "ppl_gap_median",
              "grad_norm_median", "grad_norm_p95", "grad_norm_max", "masked_frac_mean", "length_mean",
              "k3_slope_per_100", "k3_change", "step_s_median")


# -- reading ---------------------------------------------------------------------------------------------------------


def load_run_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl``, checked: every row has an int ``step`` and the :data:`REQUIRED` fields
    (a number, or null for a non-finite value).

    A half-written *last* line (a killed run) is skipped with a warning, as the trainer does. Everything else is a
    ``ValueError`` of one line naming the folder or file (and the line or step and field).
    """
    from offpolicy.train.logging import read_metrics

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise ValueError(f"run folder {str(run_dir)!r} does not exist")
    if not path.is_file():
        raise ValueError(f"run folder {str(run_dir)!r} has no metrics.jsonl")
    rows = read_metrics(path)  # names the file and line of a damaged record
    if not rows:
        raise ValueError(f"metrics file {str(path)!r} has no logged steps")
    last = 0
    for i, row in enumerate(rows, 1):
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step <= last:
            raise ValueError(f"metrics file {str(path)!r}, record {i}: 'step' is {step!r}, expected an int > {last}")
        last = step
        for key in (*REQUIRED, *OPTIONAL):
            if key not in row:
                if key in REQUIRED:
                    raise ValueError(f"metrics file {str(path)!r}, step {step}: no {key!r} field")
                continue
            value = row[key]
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"metrics file {str(path)!r}, step {step}: {key!r} is {value!r}, not a number")
    return rows


def series(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
    """``key`` per row as floats (NaN where missing or null)."""
    return [float(r[key]) if r.get(key) is not None else math.nan for r in rows]


# -- small statistics (plain python: the tests recompute them by hand) -----------------------------------------------


def finite(xs: Sequence[float | None]) -> list[float]:
    return [float(x) for x in xs if x is not None and math.isfinite(x)]


def mean(xs: Sequence[float | None]) -> float | None:
    xs = finite(xs)
    return sum(xs) / len(xs) if xs else None


def trailing_mean(ys: Sequence[float], k: int) -> list[float]:
    """Trailing mean over the finite values among the last ``k`` (shorter at the start; NaN where none is finite).

    >>> trailing_mean([1.0, 3.0, 5.0, float("nan")], 2)
    [1.0, 2.0, 4.0, 5.0]
    """
    out = []
    for i in range(len(ys)):
        window = finite(ys[max(0, i - k + 1): i + 1])
        out.append(sum(window) / len(window) if window else math.nan)
    return out


def quantile(xs: Sequence[float | None], p: float) -> float | None:
    """The ``p`` quantile by linear interpolation between order statistics (numpy's default, type 7).

    >>> round(quantile([1.0, 2.0, 3.0, 4.0, 100.0], 0.95), 6)  # position 0.95 · 4 = 3.8: 4 + 0.8 · (100 − 4)
    80.8
    """
    xs = sorted(finite(xs))
    if not xs:
        return None
    pos = p * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


def median(xs: Sequence[float | None]) -> float | None:
    return quantile(xs, 0.5)


def ls_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ``ys`` on ``xs`` (None with fewer than 2 distinct x).

    >>> ls_slope([1, 2, 3], [1.0, 3.0, 5.0])
    2.0
    """
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def spread(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """``{"median", "min", "max", "n"}`` over the finite values (seeds)."""
    xs = finite(values)
    return {"median": median(xs), "min": min(xs) if xs else None, "max": max(xs) if xs else None, "n": len(xs)}


def chance_of_separation(n: int, m: int) -> float:
    """P(the min–max ranges of n and m exchangeable draws do not overlap) = 2 / C(n + m, n): one group must hold
    the n largest (or the n smallest) of the n + m values.

    >>> chance_of_separation(3, 3)
    0.1
    """
    return 2 / math.comb(n + m, n)


def chance_of_same_sign(n: int) -> float:
    """P(n paired differences all share one sign) when each is positive or negative with probability ½,
    independently = 2 / 2ⁿ (the two-sided sign test at its most extreme outcome).

    >>> chance_of_same_sign(6)  # 2 / 64
    0.03125
    """
    return 2 / 2**n


# -- per run, per group ----------------------------------------------------------------------------------------------


def drawdown(values: Sequence[float | None], window: int = DRAWDOWN_WINDOW) -> float | None:
    """The largest fall of the ``window``-step trailing mean of ``values`` below its running maximum (0 for a curve
    that never falls) — a transient collapse that recovers shows here even when the last quarter looks fine.

    >>> drawdown([0.1, 0.5, 0.9, 0.9, 0.2, 0.9], window=1)  # 0.9 → 0.2
    0.7
    >>> drawdown([0.2, 0.4, 0.6, 0.8], window=2)             # rising: trailing means 0.2, 0.3, 0.5, 0.7
    0.0
    """
    xs = finite(values)
    if not xs:
        return None
    smooth = [sum(xs[max(0, i - window + 1): i + 1]) / len(xs[max(0, i - window + 1): i + 1]) for i in range(len(xs))]
    peak, worst = -math.inf, 0.0
    for v in smooth:
        peak = max(peak, v)
        worst = max(worst, peak - v)
    return round(worst, 12)


def run_stats(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The per-run numbers of the module docstring from one run's metric rows."""
    n = len(rows)
    q = max(1, n // 4)
    reward = series(rows, "reward/mean")
    first, last = mean(reward[:q]), mean(reward[-q:])
    k3 = series(rows, "rollout_correction/k3_kl")
    steps = [float(r["step"]) for r in rows]
    pts = [(s, math.log(max(v, K3_FLOOR))) for s, v in zip(steps, k3) if math.isfinite(v)]
    slope = ls_slope([p[0] for p in pts], [p[1] for p in pts])
    span = (pts[-1][0] - pts[0][0]) if pts else 0.0
    grad = series(rows, "loss/grad_norm")
    nonfinite = {k: sum(1 for v in series(rows, k) if not math.isfinite(v)) for k in REQUIRED}
    return {
        "steps": n,
        "quarter": q,
        "reward_first": first,
        "reward_last": last,
        "reward_gain": None if first is None or last is None else last - first,
        "reward_drawdown": drawdown(reward),
        "k3_median": median(k3),
        "exact_kl_median": median(series(rows, "mismatch/token_kl_exact_mean")),
        "ppl_gap_median": median(series(rows, "rollout_correction/log_ppl_abs_diff")),
        "grad_norm_median": median(grad),
        "grad_norm_p95": quantile(grad, 0.95),
        "grad_norm_max": max(finite(grad), default=None),
        "masked_frac_mean": mean(series(rows, "correction/masked_frac")),
        "length_mean": mean(series(rows, "response/length_mean")),
        "k3_slope_per_100": None if slope is None else 100 * slope,
        "k3_change": None if slope is None else math.exp(slope * span),
        "step_s_median": median(series(rows, "time/step_s")),
        "nonfinite": {k: v for k, v in nonfinite.items() if v},
    }


def mismatch_trend(per_seed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The trend verdict of one preset × mismatch from its runs' ``k3_slope_per_100`` and ``k3_change``."""
    slopes = [r["k3_slope_per_100"] for r in per_seed if r["k3_slope_per_100"] is not None]
    changes = [r["k3_change"] for r in per_seed if r["k3_change"] is not None]
    if not slopes:
        return {"trend": "n/a", "verdict": "n/a", "change": spread([]), "slope_per_100": spread([])}
    change = median(changes)
    if all(s > 0 for s in slopes) and change is not None and change >= GROWTH:
        trend = "growing"
    elif all(s < 0 for s in slopes) and change is not None and change <= 1 / GROWTH:
        trend = "falling"
    else:
        trend = "flat"
    return {"trend": trend, "verdict": "growing" if trend == "growing" else "bounded",
            "change": spread(changes), "slope_per_100": spread(slopes)}


def compare(values: Sequence[float | None], reference: Sequence[float | None], against: str) -> dict[str, Any]:
    """One measure of a group (one value per seed) against a reference group, by the rule of the module docstring:
    ``diff`` (median − median), ``verdict`` ("within noise" / "higher" / "lower" / "too few seeds"), ``chance``
    (p = 2 / C(n + m, n)) and both groups' ``range`` / ``ref_range`` (min, median, max).

    >>> c = compare([1.31, 1.37, 1.44], [1.9, 2.5, 10.4], "naive, lag8")  # disjoint: 1.44 < 1.9
    >>> c["verdict"], round(c["diff"], 2), c["chance"]
    ('lower', -1.13, 0.1)
    """
    a, b = finite(values), finite(reference)
    out: dict[str, Any] = {"against": against, "rule": "ranges", "n": len(a), "n_ref": len(b),
                           "range": [min(a), median(a), max(a)] if a else None,
                           "ref_range": [min(b), median(b), max(b)] if b else None}
    if len(a) < 2 or len(b) < 2:
        return {**out, "diff": None, "verdict": "too few seeds", "within_noise": None, "chance": None}
    diff = median(a) - median(b)  # type: ignore[operator]
    overlap = max(min(a), min(b)) <= min(max(a), max(b))
    verdict = "within noise" if overlap else ("higher" if diff > 0 else "lower")
    return {**out, "diff": diff, "verdict": verdict, "within_noise": overlap,
            "chance": chance_of_separation(len(a), len(b))}


def compare_paired(values: Sequence[float | None], reference: Sequence[float | None], against: str) -> dict[str, Any]:
    """One measure of a group against a reference group seed by seed (``values[i]`` and ``reference[i]`` come from
    the same seed), by the paired rule of the module docstring: ``diff`` (the median of the per-seed differences),
    ``verdict`` ("higher" / "lower" when every difference has that sign, else "within noise"; "too few seeds" under
    2 pairs), ``chance`` (p = 2 / 2ⁿ), ``wins`` (seeds where the group is higher), ``n`` pairs and both groups'
    ``range`` / ``ref_range`` (min, median, max). A seed where either value is missing or not finite is left out.

    >>> c = compare_paired([0.50, 0.40, 0.62], [0.35, 0.38, 0.45], "naive, lag8")  # +0.15, +0.02, +0.17
    >>> c["verdict"], round(c["diff"], 2), c["wins"], c["chance"]
    ('higher', 0.15, 3, 0.25)
    >>> compare_paired([0.50, 0.40, 0.62], [0.35, 0.40, 0.45], "x")["verdict"]  # a tie in the second seed
    'within noise'
    """
    if len(values) != len(reference):
        raise ValueError(f"compare_paired: {len(values)} values against {len(reference)} reference values "
                         "(one per seed on each side)")
    pairs = [(float(a), float(b)) for a, b in zip(values, reference)
             if a is not None and b is not None and math.isfinite(a) and math.isfinite(b)]
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    out: dict[str, Any] = {"against": against, "rule": "paired", "n": len(pairs), "n_ref": len(pairs),
                           "range": [min(a), median(a), max(a)] if a else None,
                           "ref_range": [min(b), median(b), max(b)] if b else None,
                           "wins": sum(x > y for x, y in pairs)}
    if len(pairs) < 2:
        return {**out, "diff": None, "verdict": "too few seeds", "within_noise": None, "chance": None}
    diffs = [x - y for x, y in pairs]
    verdict = ("higher" if all(d > 0 for d in diffs) else "lower" if all(d < 0 for d in diffs)
               else "within noise")
    return {**out, "diff": median(diffs), "verdict": verdict, "within_noise": verdict == "within noise",
            "chance": chance_of_same_sign(len(pairs))}


def compare_measures(group: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]],
                     against: str, rule: str = "ranges") -> dict[str, dict[str, Any]]:
    """:func:`compare` (``rule="ranges"``) or :func:`compare_paired` (``"paired"``: the two lists hold the same
    seeds in the same order) on every :data:`COMPARED` measure: ``{field: comparison}`` from two groups' per-run
    stats."""
    test = compare_paired if rule == "paired" else compare
    return {name: test([r[name] for r in group], [r[name] for r in reference], against)
            for name, _, _ in COMPARED}


def sweep_stats(runs: Sequence[dict[str, Any]], per_run: dict[str, dict[str, Any]],
                presets: Sequence[str], mismatches: Sequence[str], rule: str = "ranges") -> list[dict[str, Any]]:
    """One entry per preset × mismatch present in ``runs`` (summary records; ``per_run`` keyed by their ``dir``):
    every :data:`RUN_FIELDS` number as median [min–max] over seeds, the mismatch trend, and the two comparisons by
    ``rule`` (:data:`RULES`; ``"paired"`` compares the seeds both groups ran, seed by seed)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {list(RULES)}, got {rule!r}")
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["preset"], r["mismatch"]), []).append(r)
    reference = "naive" if "naive" in presets else None
    out = []
    for preset in presets:
        for mismatch in mismatches:
            members = sorted(groups.get((preset, mismatch), []), key=lambda r: r["seed"])
            if not members:
                continue
            stats = [per_run[r["dir"]] for r in members]
            entry: dict[str, Any] = {"preset": preset, "mismatch": mismatch, "seeds": [r["seed"] for r in members],
                                     "dirs": [r["dir"] for r in members]}
            for name in RUN_FIELDS:
                entry[name] = spread([s[name] for s in stats])
            entry["mismatch_trend"] = mismatch_trend(stats)

            def versus_group(p: str, m: str, against: str, members: list[dict[str, Any]] = members,
                             stats: list[dict[str, Any]] = stats) -> dict[str, dict[str, Any]]:
                others = groups.get((p, m), [])
                if rule == "paired":  # the seeds both groups ran, in seed order
                    by_seed = {r["seed"]: per_run[r["dir"]] for r in others}
                    mine = [(r["seed"], s) for r, s in zip(members, stats) if r["seed"] in by_seed]
                    return compare_measures([s for _, s in mine], [by_seed[k] for k, _ in mine], against, rule)
                return compare_measures(stats, [per_run[r["dir"]] for r in others], against)

            # every measure against naive (same engine) and against the control (same preset, fp32 engine)
            versus: dict[str, dict[str, dict[str, Any]]] = {}
            if reference is not None and preset != reference and groups.get((reference, mismatch)):
                versus["naive"] = versus_group(reference, mismatch, f"naive, {mismatch}")
            if mismatch != CONTROL and groups.get((preset, CONTROL)):
                versus["control"] = versus_group(preset, CONTROL, f"{preset}, {CONTROL}")
            entry["versus"] = versus
            entry["vs_naive"] = versus["naive"]["reward_last"] if "naive" in versus else None  # the README's column
            entry["vs_control"] = versus["control"]["reward_last"] if "control" in versus else None
            out.append(entry)
    return out


def separated(groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every comparison whose ranges over seeds do not overlap, in table order: the comparison's numbers
    (:func:`compare`) with ``preset``, ``mismatch``, ``versus`` ("naive" / "control"), ``field``, ``name`` and
    ``better`` (whether the difference goes the way :data:`COMPARED` prefers)."""
    names = {f: (n, sign) for f, n, sign in COMPARED}
    out = []
    for g in groups:
        for against, measures in g.get("versus", {}).items():
            for name, c in measures.items():
                if c["within_noise"] is False:
                    label, sign = names[name]
                    out.append({**c, "preset": g["preset"], "mismatch": g["mismatch"], "versus": against,
                                "field": name, "name": label, "better": (c["diff"] > 0) == (sign > 0)})
    return out


def load_sweep(out: str | Path) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """``(summary, {dir: metric rows})`` of a sweep folder; a missing or damaged run is a one-line ``ValueError``."""
    from offpolicy.lab.sweep_folder import read_summary

    out = Path(out)
    summary = read_summary(out)
    rows = {}
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # the half-written-last-line warning is shown, once per file
        for r in summary["runs"]:
            rows[r["dir"]] = load_run_metrics(out / r["dir"])
    return summary, rows
