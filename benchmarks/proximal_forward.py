"""Time per trainer step of decoupled PPO with the π_prox forward (``algorithm.proximal=recompute``) against AReaL's
log-linear approximation (``loglinear``, no forward), on the lab's 5 M-parameter model and the lab's step.

    python benchmarks/proximal_forward.py [--repeats 5] [--out docs/data/benchmarks/proximal_forward.json]

The step is the lab's (``offpolicy.lab.settings.LAB_BASE``: pattern task, 4 prompts × 8 samples, 32 new tokens, four
optimiser minibatches, one torch thread) under preset ``tis`` with ``algorithm.objective=decoupled``; the two arms
differ only in ``algorithm.proximal``. Same work otherwise: before every timed step each arm's model (and its engine,
synced every step) is put back to the same weights and the step runs with the same seed, so both arms sample the
same tokens; the arms alternate (recompute, loglinear, recompute, …) so that a change in the machine's load falls on
both. Prints and writes (atomically) each arm's step seconds — the whole step (rollout, scoring, update, metrics) and
its rollout, scoring and update phases, in wall seconds and in this process's CPU seconds (``time.process_time``,
little moved by other processes on a shared machine) — with median and range, and the ratios of the medians.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ARMS = ("recompute", "loglinear")


def _overrides(proximal: str, out_dir: str) -> list[str]:
    from offpolicy.lab.settings import LAB_BASE

    return [*LAB_BASE, "algorithm.preset=tis", "algorithm.objective=decoupled", f"algorithm.proximal={proximal}",
            f"run.out_dir={out_dir}"]


def _states(out_dir: str) -> dict[str, Any]:
    from offpolicy.train import steps
    from offpolicy.train.build import load_model
    from offpolicy.train.config import load_config

    first = load_config(None, _overrides("recompute", out_dir))
    model, tok = load_model(first)
    states = {}
    for arm in ARMS:
        cfg = load_config(None, _overrides(arm, out_dir))
        states[arm] = steps.build_state(cfg, model=copy.deepcopy(model), tokenizer=tok)
    return states


def _timed_step(state: Any, weights: dict[str, torch.Tensor], seed: int) -> dict[str, float]:
    """One trainer step from ``weights`` (rollout, scoring, update, metrics), its seconds and its phases'."""
    from offpolicy.train import steps
    from offpolicy.train.update import update_step

    state.model.load_state_dict(weights)
    marks = [(time.perf_counter(), time.process_time())]
    rollout = steps.rollout_step(state, seed)  # syncs the engine to the restored weights
    marks.append((time.perf_counter(), time.process_time()))
    scored = steps.score_step(state, rollout)
    marks.append((time.perf_counter(), time.process_time()))
    updates = update_step(state, rollout, scored, seed)
    marks.append((time.perf_counter(), time.process_time()))
    steps.metrics_step(state, rollout, scored, updates, started=marks[0][0])
    marks.append((time.perf_counter(), time.process_time()))
    out = {}
    for clock, i in (("", 0), ("cpu_", 1)):  # wall seconds, and CPU seconds of this process (less moved by others)
        out[f"{clock}step_s"] = marks[4][i] - marks[0][i]
        for phase, (a, b) in {"rollout_s": (0, 1), "scoring_s": (1, 2), "update_s": (2, 3)}.items():
            out[f"{clock}{phase}"] = marks[b][i] - marks[a][i]
    return out


def _summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def run(repeats: int) -> dict[str, Any]:
    from offpolicy.train.build import step_seed

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out_dir:
        states = _states(out_dir)
        weights = {k: v.detach().clone() for k, v in states["recompute"].model.state_dict().items()}
        seed = step_seed(0, 0)
        for arm in ARMS:  # warm-up: the optimiser's state, first-call allocations
            _timed_step(states[arm], weights, seed)
        load_before = os.getloadavg()
        times: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
        for _ in range(repeats):
            for arm in ARMS:
                times[arm].append(_timed_step(states[arm], weights, seed))
        load_after = os.getloadavg()
    result: dict[str, Any] = {
        "what": "seconds per trainer step, decoupled PPO (preset tis, objective decoupled) with the π_prox forward "
                "(recompute) vs AReaL's log-linear approximation (loglinear)",
        "model": "lab (embedded, 5 M parameters), float32, CPU, 1 torch thread",
        "step": "LAB_BASE: pattern task, 4 prompts x 8 samples, 32 new tokens, 4 optimiser minibatches; engine synced "
                "every step, same weights and seed before every timed step",
        "repeats": repeats, "order": "alternating, recompute first",
        "machine": {"cpu_count": os.cpu_count(), "loadavg_1m_before": load_before[0], "loadavg_1m_after": load_after[0],
                    "note": "shared machine (other jobs running); medians and ranges, not means"},
        "arms": {arm: {phase: _summary([t[phase] for t in times[arm]]) for phase in times[arm][0]} for arm in ARMS},
    }
    med = {arm: result["arms"][arm]["step_s"]["median"] for arm in ARMS}
    result["loglinear_over_recompute_step_median"] = med["loglinear"] / med["recompute"]
    cpu = {arm: result["arms"][arm]["cpu_step_s"]["median"] for arm in ARMS}
    result["loglinear_over_recompute_cpu_step_median"] = cpu["loglinear"] / cpu["recompute"]
    result["saved_scoring_s_median"] = (result["arms"]["recompute"]["scoring_s"]["median"]
                                        - result["arms"]["loglinear"]["scoring_s"]["median"])
    return result


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically: a temporary file in the same folder, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(f.name, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("docs/data/benchmarks/proximal_forward.json"))
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    result = run(args.repeats)
    for arm in ARMS:
        a = result["arms"][arm]
        print(f"{arm:10s} step {a['step_s']['median']:.2f} s [{a['step_s']['min']:.2f}, {a['step_s']['max']:.2f}]  "
              f"scoring {a['scoring_s']['median']:.3f} s  update {a['update_s']['median']:.2f} s  "
              f"rollout {a['rollout_s']['median']:.2f} s")
    for arm in ARMS:
        a = result["arms"][arm]
        print(f"{arm:10s} CPU seconds: step {a['cpu_step_s']['median']:.2f} [{a['cpu_step_s']['min']:.2f}, "
              f"{a['cpu_step_s']['max']:.2f}]  scoring {a['cpu_scoring_s']['median']:.3f}  "
              f"update {a['cpu_update_s']['median']:.2f}  rollout {a['cpu_rollout_s']['median']:.2f}")
    print(f"loglinear / recompute (step medians): wall {result['loglinear_over_recompute_step_median']:.3f}, "
          f"CPU {result['loglinear_over_recompute_cpu_step_median']:.3f}")
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
