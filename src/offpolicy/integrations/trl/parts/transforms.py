"""The log-prob transforms of an ``OffPolicyGRPOTrainer`` run, as :func:`offpolicy.transforms.apply_transforms` runs
them on each loss batch: the built-in ones with a batch step that the keywords turn on (score centering's centre,
top-K TRM's bound) and a recipe's plug-in transforms, in the recipe's order after them.

The forward-only ones (DVP, sampling replay, ALP) have no batch step: the scoring forward computes them
(:mod:`~offpolicy.integrations.trl.parts.scoring`, :mod:`~offpolicy.integrations.trl.parts.alp`).
"""

from __future__ import annotations

from typing import Any

from offpolicy.registry import BoundTransform, build_transform


def trl_transforms(recipe: Any, *, topk_logprobs: int, topk_bound: str, score_centering: bool) -> list[BoundTransform]:
    """The run's transforms with a batch step: ``score_centering`` on vLLM's top-K (``score_centering=True``),
    ``topk_bounds`` (``topk_logprobs`` > 0, ``topk_bound``), then ``recipe``'s plug-ins (None: no recipe).

    >>> [t.name for t in trl_transforms(None, topk_logprobs=8, topk_bound="upper", score_centering=True)]
    ['score_centering', 'topk_bounds']
    """
    out: list[BoundTransform] = []
    if score_centering:
        out.append(build_transform({"name": "score_centering", "source": "topk", "k": topk_logprobs}))
    if topk_logprobs:
        out.append(build_transform({"name": "topk_bounds", "k": topk_logprobs, "bound": topk_bound}))
    if recipe is not None:
        out.extend(t for t in recipe.bound_transforms() if t.plugin)
    return out
