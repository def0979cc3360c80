"""The TRL plug-in's scoring part alone, without a TRL trainer around it: what the multi-process tests call on a
sharded model (:meth:`~offpolicy.integrations.trl.parts.scoring.ReplayScoring._offpolicy_scores`)."""

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
