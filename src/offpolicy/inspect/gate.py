"""The CI gate: ``--fail-above kl=1e-3,max_kl=0.05`` fails a run whose measured mismatch exceeds a bound.

Metric names are ``report.json`` keys (any numeric top-level key), plus short aliases: ``kl`` = ``kl_mean``,
``max_kl`` = ``kl_max``, ``median_kl`` = ``kl_median``, ``p99_kl`` = ``kl_p99``, ``tv`` = ``tv_mean``,
``max_tv`` = ``tv_max``, ``delta`` = ``sampled_abs_delta_mean``,
``max_delta`` = ``sampled_abs_delta_max``, ``tail_head`` = ``tail_head_ratio``. A metric that could not be measured
(null, e.g. a non-finite KL) fails its bound: a gate never passes on a missing number.
"""

from __future__ import annotations

import math
from typing import Any

ALIASES = {"kl": "kl_mean", "max_kl": "kl_max", "median_kl": "kl_median", "p99_kl": "kl_p99", "tv": "tv_mean",
           "max_tv": "tv_max", "delta": "sampled_abs_delta_mean", "max_delta": "sampled_abs_delta_max",
           "tail_head": "tail_head_ratio"}
# The numeric top-level keys of report.json (offpolicy.inspect.summary.summarize): checked before any work is done.
REPORT_METRICS = frozenset({
    "kl_mean", "kl_median", "kl_p99", "kl_max", "kl_upper_mean", "kl_reverse_mean", "kl_nonfinite_positions", "tv_mean", "tv_max",
    "topk_overlap_mean", "sampled_abs_delta_mean", "sampled_abs_delta_max", "sampled_nonfinite", "tail_head_ratio",
    "tail_abs_delta_mean", "head_abs_delta_mean", "pearson_r", "ess", "chi2_token", "chi2_seq", "k3_kl",
})


def parse_bounds(text: str, option: str = "--fail-above") -> dict[str, float]:
    """``"kl=1e-3,max_kl=0.05"`` → ``{"kl_mean": 0.001, "kl_max": 0.05}`` (aliases resolved).

    >>> parse_bounds("kl=1e-3, max_kl=0.05")
    {'kl_mean': 0.001, 'kl_max': 0.05}
    >>> parse_bounds("kl")
    Traceback (most recent call last):
    ...
    ValueError: --fail-above: 'kl' is not metric=bound (e.g. kl=1e-3,max_kl=0.05)
    """
    bounds: dict[str, float] = {}
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"{option}: {part!r} is not metric=bound (e.g. kl=1e-3,max_kl=0.05)")
        try:
            bound = float(value)
        except ValueError:
            raise ValueError(f"{option}: the bound of {name!r} is {value.strip()!r}, not a number") from None
        if not math.isfinite(bound):
            raise ValueError(f"{option}: the bound of {name!r} must be finite, got {value.strip()!r}")
        metric = ALIASES.get(name, name)
        if metric not in REPORT_METRICS:
            raise ValueError(f"{option}: unknown metric {name!r}; use one of: "
                             f"{', '.join(sorted(set(ALIASES) | REPORT_METRICS))}")
        bounds[metric] = bound
    if not bounds:
        raise ValueError(f"{option}: no metric=bound given (e.g. kl=1e-3,max_kl=0.05)")
    return bounds


def check_bounds(summary: dict[str, Any], bounds: dict[str, float]) -> list[str]:
    """One line per violated bound (empty: every metric is within its bound). Unknown metrics raise ``ValueError``.

    >>> check_bounds({"kl_mean": 2e-3, "kl_max": 0.01}, {"kl_mean": 1e-3, "kl_max": 0.05})
    ['kl_mean = 0.002 > 0.001 (--fail-above)']
    """
    numeric = {k for k, v in summary.items() if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))}
    failures = []
    for name, bound in bounds.items():
        if name not in summary or name not in numeric:
            known = ", ".join(sorted(set(ALIASES) | numeric))
            raise ValueError(f"--fail-above: unknown metric {name!r}; use one of: {known}")
        value = summary[name]
        if value is None:
            failures.append(f"{name} = not measured (non-finite or unavailable) — bound {bound:g} (--fail-above)")
        elif value > bound:
            failures.append(f"{name} = {value:.4g} > {bound:g} (--fail-above)")
    return failures
