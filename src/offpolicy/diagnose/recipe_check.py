"""``offpolicy doctor --recipe FILE``: a :class:`~offpolicy.Recipe` checked before a run, without a server — valid,
what it needs from the engine (:func:`offpolicy.recipe.needs`), and whether each host (the reference trainer, TRL's
trainer, verl's plug-in) accepts it, in the host's own reading of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["recipe_checks"]


def recipe_checks(path: str | Path) -> list[str]:
    """``offpolicy doctor --recipe FILE``: the recipe validated (a ``ValueError`` naming the key otherwise), what it
    needs (:func:`offpolicy.recipe.needs`) and, for each host, whether it accepts the recipe or the one line it
    refuses it with (the host's own reading of it: the trainer's config, TRL's keywords and their checks, verl's
    block parser)."""
    from offpolicy.recipe import Recipe, needs
    from offpolicy.registry import NEEDS

    recipe = Recipe.load(Path(path), where="--recipe")
    lines = [f"valid: {', '.join(recipe.to_dict()) or 'empty (every host keeps its defaults)'}"]
    for need, who in needs(recipe).items():
        lines.append(f"needs {need} ({NEEDS[need]}): {', '.join(who)}")
    for host, read in (("trainer", _trainer_reads), ("trl", _trl_reads), ("verl", _verl_reads)):
        try:
            read(recipe)
        except ValueError as err:
            lines.append(f"{host}: refused: {err}")
        else:
            lines.append(f"{host}: accepted")
    return lines


def _trainer_reads(recipe: Any) -> None:
    from pydantic import ValidationError

    from offpolicy.train.config import TrainConfig
    from offpolicy.train.overrides import explain

    try:
        TrainConfig.model_validate({"algorithm": {"recipe": recipe.to_dict()}})
    except ValidationError as err:
        raise ValueError(explain(err)) from None


def _trl_reads(recipe: Any) -> None:
    from offpolicy.integrations.trl.parts.alp import _check_alp
    from offpolicy.integrations.trl.parts.topk import _check_score_centering
    from offpolicy.recipe.hosts import trl_keywords

    kw = trl_keywords(recipe, {"sampling_replay": False, "dvp_rho": None, "alp": None, "topk_logprobs": 0,
                               "score_centering": False})
    _check_alp(kw["alp"])
    _check_score_centering(kw["score_centering"], kw["topk_logprobs"], kw["sampling_replay"] or kw["dvp_rho"]
                           is not None)


def _verl_reads(recipe: Any) -> None:
    from offpolicy.integrations.verl.settings import parse_settings

    parse_settings({"recipe": recipe.to_dict()})
