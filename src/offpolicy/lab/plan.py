"""A sweep's plan: presets × mismatch sources × seeds of a named setting (:mod:`offpolicy.lab.settings`), each run
with its complete trainer overrides, every one validated before any work. :mod:`offpolicy.lab.sweep` runs it.

>>> plan = plan_sweep("/tmp/lab", "quick", presets="naive,mis", mismatches="bf16", seeds=2)
>>> [run.name for run in plan.runs][:3], plan.runs[0].dir
(['naive__none__s0', 'naive__none__s1', 'naive__bf16__s0'], 'runs/naive__none__s0')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offpolicy.lab.mismatch import CONTROL, canonical_mismatch, describe_mismatch, engine_keys, mismatch_overrides
from offpolicy.lab.settings import VARIANTS, get_setting, resolve_preset
from offpolicy.train.presets import PRESETS

# Config keys the sweep sets per run, with the option that sets them (a user override of these would make the
# folder names lie).
_SWEEP_KEYS = {"algorithm.preset": "--presets", "run.seed": "--seeds", "run.steps": "--steps",
               "run.out_dir": "--out", **{k: "--mismatch" for k in engine_keys()}}


@dataclass(frozen=True)
class PlannedRun:
    """One run of a sweep: ``dir`` is relative to the sweep folder, ``overrides`` are its complete trainer overrides."""

    preset: str
    mismatch: str
    seed: int
    steps: int
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.preset}__{self.mismatch}__s{self.seed}"

    @property
    def dir(self) -> str:
        return f"runs/{self.name}"

    def record(self) -> dict[str, Any]:
        """The run's entry in ``summary.json``."""
        return {"preset": self.preset, "mismatch": self.mismatch, "seed": self.seed, "dir": self.dir,
                "steps": self.steps}


@dataclass
class SweepPlan:
    """What a sweep will run: the setting's name, the axes, the shared overrides and every run (plan order)."""

    out: Path
    setting: str
    description: str
    presets: list[str]
    mismatches: list[str]
    seeds: list[int]
    steps: int
    overrides: list[str]  # the setting's base overrides followed by the user's
    runs: list[PlannedRun]

    def describe(self) -> dict[str, Any]:
        """The plan as JSON-able data (``summary.json["plan"]``)."""
        return {"presets": self.presets, "mismatches": self.mismatches, "seeds": self.seeds, "steps": self.steps,
                "overrides": self.overrides, "runs": [r.record() for r in self.runs],
                "engines": {m: describe_mismatch(m) for m in self.mismatches}}



def _split_list(value: str | Sequence[str] | None, option: str) -> list[str] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    items = [i.strip() for i in items if i.strip()]
    if not items:
        raise ValueError(f"{option} is empty")
    if len(set(items)) != len(items):
        raise ValueError(f"{option} names an entry twice: {items}")
    return items


def plan_sweep(out: str | Path, setting: str = "quick", *, presets: str | Sequence[str] | None = None,
               mismatches: str | Sequence[str] | None = None, seeds: int | None = None, steps: int | None = None,
               overrides: Sequence[str] = ()) -> SweepPlan:
    """The sweep ``setting`` (:mod:`offpolicy.lab.settings`) with the given axes replaced, every run validated.

    ``presets`` / ``mismatches``: comma-separated text or a list; the ``none`` control is always part of the plan
    (added first when missing) — for the setting's ``control_presets`` (and naive) among the presets asked for, or for
    every preset when it names none of them or ``mismatches`` names the control. ``seeds``: how many (seeds 0 … n−1). ``overrides``: trainer ``key=value`` for
    every run, applied after the setting's; keys the sweep sets itself (the preset, seed, steps, out_dir and the
    rollout engine's numerics) are refused, naming the option that sets them.

    Raises ``ValueError`` with one line naming the option, the override or the run that is wrong.
    """
    from offpolicy.train.config import load_config

    s = get_setting(setting)
    known = sorted([*PRESETS, *VARIANTS])
    out = Path(out)
    preset_names = _split_list(presets, "--presets") or list(s["presets"])
    for p in preset_names:
        if p not in PRESETS and p not in VARIANTS:
            raise ValueError(f"--presets: {p!r} is not a preset; choose from {known}")
    names = _split_list(mismatches, "--mismatch") or list(s["mismatches"])
    canon = [canonical_mismatch(m) for m in names]
    if len(set(canon)) != len(canon):
        raise ValueError(f"--mismatch names the same engine twice: {names}")
    named_control = mismatches is not None and CONTROL in canon
    if CONTROL not in canon:
        canon.insert(0, CONTROL)  # the control is part of every comparison
    n_seeds = s["seeds"] if seeds is None else seeds
    if isinstance(n_seeds, bool) or not isinstance(n_seeds, int) or n_seeds < 1:
        raise ValueError(f"--seeds must be an int >= 1, got {n_seeds!r}")
    n_steps = s["steps"] if steps is None else steps
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"--steps must be an int >= 1, got {n_steps!r}")
    user = list(overrides)
    for item in user:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.sub=value")
        key = item.split("=", 1)[0].strip()
        if key in _SWEEP_KEYS:
            raise ValueError(f"override {item!r}: the sweep sets {key} itself (use {_SWEEP_KEYS[key]})")
    shared = [*s["overrides"], *user]
    runs = []
    # the presets that also run on the fp32 control: the setting's choice among those asked for (on the fp32 engine
    # the IS weights are 1, so a correction would repeat naive's runs), or all of them when it names none of them
    controlled = [p for p in s.get("control_presets", preset_names) if p in preset_names] or preset_names
    if named_control:
        controlled = preset_names  # the control asked for by name: every preset runs there
    if "naive" in preset_names and "naive" not in controlled:
        controlled = ["naive", *controlled]
    # the engines that are controls (the fp32 one, and a setting's own, e.g. vLLM in fp32): only `controlled` runs there
    controls = {CONTROL, *(s.get("control_mismatches") or ())}
    for preset in preset_names:
        base, variant = resolve_preset(preset)
        for mismatch in canon:
            if mismatch in controls and preset not in controlled:
                continue
            for seed in range(n_seeds):
                run_overrides = (*s["overrides"], *mismatch_overrides(mismatch), f"algorithm.preset={base}",
                                 *(["alp.enabled=true"] if base in PRESETS and PRESETS[base].alp else []), *variant, f"run.seed={seed}",
                                 f"run.steps={n_steps}", *user)
                run = PlannedRun(preset, mismatch, seed, n_steps, run_overrides)
                runs.append(PlannedRun(preset, mismatch, seed, n_steps,
                                       (*run_overrides, f"run.out_dir={out / run.dir}")))
    for run in runs:  # every run validated before any work
        try:
            load_config(None, list(run.overrides))
        except ValueError as err:
            raise ValueError(f"run {run.name}: {err}") from None
    return SweepPlan(out, setting, s["description"], preset_names, canon, list(range(n_seeds)), n_steps, shared,
                     runs)


def planned_config(run: PlannedRun):  # -> TrainConfig
    from offpolicy.train.config import load_config

    return load_config(None, list(run.overrides))
