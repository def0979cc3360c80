"""The presets of :mod:`offpolicy.train.presets` as named recipes: the same corrections (with the trainer's default
``algorithm.*`` values written out), objective and transforms, as data any host reads.

``offpolicy presets`` lists them, ``offpolicy presets NAME`` prints one as YAML (a file to start from), and
``algorithm.recipe: NAME``-style use goes through :func:`named_recipe`.

>>> named_recipe("dvp_mis").correction_specs()
[{'name': 'dvp_keep'}, {'name': 'mis', 'level': 'token'}]
>>> named_recipe("tiss")
Traceback (most recent call last):
...
ValueError: unknown recipe 'tiss' (did you mean 'tis'?); named recipes: alp, alp_score_centering, alp_score_centering_topk, dvp, dvp_mis, geo_mask, icepop, ipo, m2po, mis, naive, opsm, score_centering, score_centering_icepop, score_centering_replay, score_centering_tis, score_centering_topk, tis, trm
"""

from __future__ import annotations

import math
from typing import Any

from offpolicy.recipe.schema import Recipe
from offpolicy.registry import nearest

__all__ = ["NAMED_RECIPES", "named_recipe"]

_RHO = math.exp(-13)  # DVP's ρ (arXiv 2512.23087)
_TOPK = {"source": "topk", "k": 20}  # the sampler's top-20 head (vLLM's default max_logprobs)

# name → the recipe's data; the trainer's defaults written out (is_level token, opsm δ 1e-4, TRM's 0.05 / 0.001)
NAMED_RECIPES: dict[str, dict[str, Any]] = {
    "naive": {"corrections": [], "objective": "ppo"},
    "tis": {"corrections": [{"name": "tis", "level": "token"}], "objective": "ppo"},
    "mis": {"corrections": [{"name": "mis", "level": "token"}], "objective": "ppo"},
    "geo_mask": {"corrections": [{"name": "geo_mask"}], "objective": "ppo"},
    "icepop": {"corrections": [{"name": "icepop"}], "objective": "ppo"},
    "opsm": {"corrections": [{"name": "opsm", "delta": 1e-4}], "objective": "ppo"},
    "trm": {"corrections": [{"name": "trm", "max_kl": 0.05, "avg_kl": 0.001}], "objective": "ppo",
            "transforms": {"exact_kl": {}}},
    "dvp": {"corrections": [], "objective": "ppo", "transforms": {"dvp": {"rho": _RHO}}},
    "dvp_mis": {"corrections": [{"name": "mis", "level": "token"}], "objective": "ppo",
                "transforms": {"dvp": {"rho": _RHO}}},
    "alp": {"corrections": [], "objective": {"name": "bypass", "dual_clip": 10.0}, "transforms": {"alp": {}}},
    "m2po": {"corrections": [{"name": "m2po"}], "objective": "ppo"},
    "ipo": {"corrections": [], "objective": "ipo"},
    "score_centering": {"corrections": [], "objective": "ppo", "transforms": {"score_centering": {"source": "exact"}}},
    "score_centering_topk": {"corrections": [], "objective": "ppo", "transforms": {"score_centering": dict(_TOPK)}},
    "score_centering_tis": {"corrections": [], "objective": "ppo",
                            "transforms": {"score_centering": {**_TOPK, "weighting": "tis"}}},
    "score_centering_icepop": {"corrections": [], "objective": "ppo",
                               "transforms": {"score_centering": {**_TOPK, "weighting": "icepop"}}},
    "score_centering_replay": {"corrections": [], "objective": "ppo",
                               "transforms": {"score_centering": {**_TOPK, "weighting": "replay"}}},
    "alp_score_centering": {"corrections": [], "objective": {"name": "bypass", "dual_clip": 10.0},
                            "transforms": {"alp": {}, "score_centering": {"source": "exact"}}},
    "alp_score_centering_topk": {"corrections": [], "objective": {"name": "bypass", "dual_clip": 10.0},
                                 "transforms": {"alp": {}, "score_centering": dict(_TOPK)}},
}


def named_recipe(name: str) -> Recipe:
    """The :class:`Recipe` of preset ``name``."""
    if name not in NAMED_RECIPES:
        names = sorted(NAMED_RECIPES)
        raise ValueError(f"unknown recipe {name!r}{nearest(name, names)}; named recipes: {', '.join(names)}")
    return Recipe.load(NAMED_RECIPES[name], where=f"recipe {name!r}")
