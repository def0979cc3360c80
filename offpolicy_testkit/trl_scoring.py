"""The multi-process tests of sharded trainers: the TRL plug-in's scoring part alone, without a TRL trainer around it
(:meth:`~offpolicy.integrations.trl.parts.scoring.ReplayScoring._offpolicy_scores`, called on a sharded model), and
the launcher of their two ranks."""

from __future__ import annotations


def scoring_part(recipe, centering: bool = False, temperature: float = 0.7, bounds: bool | None = None):
    """A ``ReplayScoring`` with the settings its forward reads: the recipe to replay (None: the engine's top-K only),
    vLLM's filter order, score centering on or off, the top-K bounds (None: as ``_setup_topk`` decides without a TRM,
    off under the centring), TRL's temperature."""
    from types import SimpleNamespace

    from offpolicy.integrations.trl.parts.scoring import ReplayScoring
    from offpolicy.integrations.trl.replay import ENGINE_ORDERS

    s = ReplayScoring.__new__(ReplayScoring)
    s.offpolicy_recipe, s.offpolicy_order, s.offpolicy_budget = recipe, ENGINE_ORDERS["vllm"], 2**26
    s.args = SimpleNamespace(temperature=temperature)
    s.offpolicy_score_centering, s._offpolicy_advice_ks = centering, None
    s.offpolicy_topk_bounds = not centering if bounds is None else bounds
    return s


def run_two_ranks(script, out, *, env=None, timeout: float = 600) -> list[dict]:
    """Run ``script`` as two processes (:func:`offpolicy_testkit.gloo_ranks.run_ranks`, ``env`` added to theirs) and
    return each rank's ``OUT/rank{r}.json``; a rank that fails or hangs fails the test with the ranks' output tails."""
    import json
    from pathlib import Path

    from offpolicy_testkit.gloo_ranks import run_ranks

    run_ranks(script, out, timeout=timeout, env=env, hung=f"a rank of {Path(script).name} hung")
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
