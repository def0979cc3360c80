"""offpolicy.lab: sweeps of presets × rollout-engine mismatch sources × seeds, and their report.

* :mod:`~offpolicy.lab.mismatch` — named, deterministic mismatch sources (``none`` = the fp32 control, ``bf16``,
  ``int8``, ``int4``, ``kv8``, ``kv4``, ``noise``; ``a+b`` combinations) as trainer overrides;
* :mod:`~offpolicy.lab.settings` — named settings (``quick``, ``full``): shared overrides + the default plan;
* :mod:`~offpolicy.lab.plan` — a sweep's plan: every run's overrides, validated before any work;
* :mod:`~offpolicy.lab.sweep` — the runner: one trainer process per run, bounded parallelism, resume
  (:mod:`~offpolicy.lab.sweep_folder`: the run folders' state and ``summary.json``);
* :mod:`~offpolicy.lab.ray_exec` — the same runner's runs as Ray actors (``run_sweep(plan, executor=RayExecutor())``);
* :mod:`~offpolicy.lab.stats` / :mod:`~offpolicy.lab.plots` / :mod:`~offpolicy.lab.report` — the numbers over
  seeds, the figures, and ``report.html`` + ``lab_table.md`` + ``lab_stats.json``.

>>> plan = plan_sweep("/tmp/lab", "quick", presets="naive,mis", mismatches="bf16", seeds=3)
>>> len(plan.runs), plan.mismatches, plan.runs[0].dir
(9, ['none', 'bf16'], 'runs/naive__none__s0')
"""

from offpolicy.lab.mismatch import (
    CONTROL,
    SOURCES,
    canonical_mismatch,
    describe_mismatch,
    mismatch_overrides,
    mismatch_settings,
)
from offpolicy.lab.plan import PlannedRun, SweepPlan, plan_sweep
from offpolicy.lab.ray_exec import RayExecutor
from offpolicy.lab.report import LabReport, write_report
from offpolicy.lab.settings import SETTINGS, get_setting
from offpolicy.lab.stats import load_run_metrics, run_stats, sweep_stats
from offpolicy.lab.sweep import run_sweep
from offpolicy.lab.sweep_folder import SweepResult, read_summary, run_state

__all__ = [
    "CONTROL",
    "LabReport",
    "PlannedRun",
    "RayExecutor",
    "SETTINGS",
    "SOURCES",
    "SweepPlan",
    "SweepResult",
    "canonical_mismatch",
    "describe_mismatch",
    "get_setting",
    "load_run_metrics",
    "mismatch_overrides",
    "mismatch_settings",
    "plan_sweep",
    "read_summary",
    "run_state",
    "run_stats",
    "run_sweep",
    "sweep_stats",
    "write_report",
]
