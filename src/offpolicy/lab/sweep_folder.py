"""What a sweep folder holds: the state of each run folder (done, partial, new; a config that differs from the
plan) and ``summary.json``, the sweep's record of its finished, failed and pending runs (the layout is in
:mod:`offpolicy.lab.sweep`)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from offpolicy.atomic_files import write_atomic
from offpolicy.lab.plan import PlannedRun, SweepPlan, planned_config

SUMMARY = "summary.json"
# Config keys that may differ between a run folder and the plan without changing the run's numbers.
_FREE_KEYS = ("run.steps", "run.out_dir", "run.progress", "run.tensorboard", "run.checkpoint_every", "run.threads",
              "run.device", "model.cache_dir")


@dataclass
class FailedRun:
    run: PlannedRun
    error: str  # the last line of the run's log (or why the runner gave up on it)
    returncode: int | None


@dataclass
class SweepResult:
    """What :func:`~offpolicy.lab.sweep.run_sweep` did: finished runs (skipped ones included), failures, and whether it was stopped."""

    plan: SweepPlan
    done: list[PlannedRun] = field(default_factory=list)
    skipped: list[PlannedRun] = field(default_factory=list)  # finished before this sweep started
    failed: list[FailedRun] = field(default_factory=list)
    interrupted: bool = False

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.plan.runs)


# -- the state of a run folder ---------------------------------------------------------------------------------------


def _metrics_last_step(run_dir: Path) -> int | None:
    """The last logged step of a readable ``metrics.jsonl`` whose steps increase (None if unreadable / empty)."""
    from offpolicy.train.logging import read_metrics

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    try:
        with warnings.catch_warnings():  # a half-written last line: the run simply is not finished
            warnings.simplefilter("ignore")
            rows = read_metrics(path)
    except ValueError:
        return None
    steps: list[int] = []
    for row in rows:
        step = row.get("step")
        if not isinstance(step, int):
            return None
        steps.append(step)
    if not steps or steps != sorted(set(steps)):
        return None
    return steps[-1]


def run_state(out: str | Path, run: PlannedRun) -> tuple[str, int]:
    """``("done" | "partial" | "new", checkpoint step)`` of a run folder.

    done: the final checkpoint exists and ``metrics.jsonl`` reaches ``run.steps``; partial: a checkpoint before the
    last step (the run resumes from it); new: nothing to resume (no checkpoint, or a final checkpoint whose metrics
    are incomplete: the run starts again).
    """
    from offpolicy.train.checkpoint import checkpoint_path, latest_checkpoint

    run_dir = Path(out) / run.dir
    latest = latest_checkpoint(run_dir / "checkpoints")
    if latest is None:
        return "new", 0
    step = int(latest.stem.split("_")[-1])
    if step == run.steps and checkpoint_path(run_dir / "checkpoints", run.steps).is_file():
        return ("done", step) if _metrics_last_step(run_dir) == run.steps else ("new", 0)
    if step > run.steps:
        raise ValueError(f"run folder {str(run_dir)!r} holds a checkpoint at step {step}, past --steps {run.steps}; "
                         "raise --steps or use another --out")
    return "partial", step


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name not in ("model.tiny_config", "task.options"):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def config_conflicts(out: str | Path, run: PlannedRun) -> list[str]:
    """``key: folder value ≠ planned value`` for each config key where the run folder's ``config.yaml`` differs from
    the plan (keys that do not change the numbers — steps, paths, logging — are not compared). A key the folder's
    config lacks (written before the key existed) counts as its default. Empty when the folder has no config yet."""
    import yaml

    path = Path(out) / run.dir / "config.yaml"
    if not path.is_file():
        return []
    try:
        found = _flatten(yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    except (OSError, yaml.YAMLError, AttributeError) as err:
        raise ValueError(f"run folder {str(path.parent)!r}: its config.yaml cannot be read ({err})") from None
    planned = _flatten(planned_config(run).model_dump(mode="json"))
    from offpolicy.train.config import load_config

    defaults = _flatten(load_config(None, []).model_dump(mode="json"))
    found = {**{k: v for k, v in defaults.items() if k in planned}, **found}
    return [f"{k}={found.get(k)!r} (planned {planned.get(k)!r})" for k in sorted(set(found) | set(planned))
            if k not in _FREE_KEYS and _norm(found.get(k)) != _norm(planned.get(k))]


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value



# -- summary.json ----------------------------------------------------------------------------------------------------


def write_summary(result: SweepResult) -> Path:
    """Write ``OUT/summary.json`` atomically (temp file in ``OUT`` + ``os.replace``): a reader sees the old or the new
    file, never half of one."""
    plan = result.plan
    finished = {r.name for r in result.done}
    failed = {f.run.name: f for f in result.failed}
    data = {
        "runs": [r.record() for r in plan.runs if r.name in finished],
        "setting": plan.setting,
        "description": plan.description,
        "complete": result.complete,
        "failed": [{**f.run.record(), "error": f.error, "returncode": f.returncode} for f in result.failed],
        "pending": [r.record() for r in plan.runs if r.name not in finished and r.name not in failed],
        "plan": plan.describe(),
        "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    path = plan.out / SUMMARY
    write_atomic(path, json.dumps(data, indent=1), prefix=".summary-", suffix=".json")
    return path


def read_summary(out: str | Path) -> dict[str, Any]:
    """``OUT/summary.json`` (``ValueError`` naming the file when it is missing or not a sweep summary)."""
    path = Path(out) / SUMMARY
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist: no sweep in {str(out)!r} (run `offpolicy lab --out {out}`)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{str(path)!r} is not readable JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ValueError(f"{str(path)!r} has no 'runs' list: not a sweep summary")
    for i, r in enumerate(data["runs"]):
        missing = [k for k in ("preset", "mismatch", "seed", "dir", "steps") if not isinstance(r, dict) or k not in r]
        if missing:
            raise ValueError(f"{str(path)!r}: runs[{i}] lacks {', '.join(missing)}")
    return data
