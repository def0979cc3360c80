"""The multi-process tests of sharded trainers: the TRL plug-in's scoring part alone, without a TRL trainer around it
(:meth:`~offpolicy.integrations.trl.parts.scoring.ReplayScoring._offpolicy_scores`, called on a sharded model), and
the launcher of their two ranks."""

from __future__ import annotations


def scoring_part(recipe, centering: bool = False, temperature: float = 0.7):
    """A ``ReplayScoring`` with the settings its forward reads: the recipe to replay (None: the engine's top-K only),
    vLLM's filter order, score centering on or off, TRL's temperature."""
    from types import SimpleNamespace

    from offpolicy.integrations.trl.parts.scoring import ReplayScoring
    from offpolicy.integrations.trl.replay import ENGINE_ORDERS

    s = ReplayScoring.__new__(ReplayScoring)
    s.offpolicy_recipe, s.offpolicy_order, s.offpolicy_budget = recipe, ENGINE_ORDERS["vllm"], 2**26
    s.args = SimpleNamespace(temperature=temperature)
    s.offpolicy_score_centering, s._offpolicy_advice_ks = centering, None
    return s


def run_two_ranks(script, out, *, env=None, timeout: float = 600) -> list[dict]:
    """Run ``script`` as two processes (``python script RANK 2 PORT OUT``, one thread each, the repository root on
    their path) and return each rank's ``OUT/rank{r}.json``; a rank that fails or hangs fails the test with the
    ranks' output tails."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from offpolicy.rollout.processes import free_port

    root = str(Path(__file__).resolve().parents[1])  # offpolicy_testkit/, for the ranks as for pytest
    port = free_port()
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
                "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(port), str(out)], env=full_env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a rank of {Path(script).name} hung") from None
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
