"""The embedded models as recipes: an architecture (overrides of :data:`TINY_CONFIG`), a task and a warm start.

=====  ==================================================  ========================================================
name   architecture                                        warm start
=====  ==================================================  ========================================================
tiny   Qwen2, hidden 128, 4 layers, ≈1.3 M parameters      500 steps on arithmetic (the demo task before the lab)
lab    Qwen2, hidden 256, 4 layers, MLP 1024, ≈5.0 M       pattern continuation: the rule learned on noisy prefixes,
                                                           then calibrated to sample it with p ≈ 0.2 (see
                                                           :mod:`offpolicy.models.warm_start`)
lab-   Qwen3-MoE, hidden 256, 4 layers, 8 experts of MLP   the lab model's task and warm start
moe    128, top-2 routing, ≈5.0 M (≈2.6 M active a token)
=====  ==================================================  ========================================================

``lab-moe`` has the dense lab model's attention, embeddings and parameter count; its MLP is split into 8 experts of
width 128 (the dense MLP's 1024 = 8 × 128), 2 of which each token uses. A bf16 engine on it flips experts at router
near-ties (:mod:`offpolicy.rollout.routing`), a mismatch the dense model does not have.

Both use the 4,099-token byte-level BPE of :mod:`offpolicy.models.tokenizer`: a few dozen tokens carry the mass, and
thousands form the long low-probability tail where a bf16 engine's errors are largest. ``config`` overrides on top of
a recipe (``model.tiny_config`` in the trainer) warm-start a model of another size with the same recipe.

>>> RECIPES["lab"].task_name, RECIPES["lab"].config["hidden_size"]
('pattern', 256)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from offpolicy.models.warm_start import WarmStartRecipe


@dataclass(frozen=True)
class ModelRecipe:
    """A named embedded model: config overrides, the warm-start task (built-in name + arguments) and recipe."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)
    architecture: str = "qwen2"  # a key of offpolicy.models.tiny.ARCHITECTURES
    task_name: str = "arithmetic"
    task_args: dict[str, Any] = field(default_factory=dict)
    warm: WarmStartRecipe = field(default_factory=WarmStartRecipe)

    def task(self):  # -> Task
        from offpolicy.tasks import BUILTIN_TASKS

        return BUILTIN_TASKS[self.task_name](**self.task_args)

    def with_overrides(self, config: dict[str, Any] | None = None, **warm: Any) -> ModelRecipe:
        """This recipe with architecture overrides and warm-start fields replaced (``steps=5``)."""
        return replace(self, config={**self.config, **(config or {})}, warm=replace(self.warm, **warm))


LAB_CONFIG: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
                              "num_attention_heads": 4, "num_key_value_heads": 2}

# Qwen3-MoE routing: 8 experts of width 128 (together the dense MLP's 1024), top-2, weights renormalised over the
# two (as Qwen3-MoE ships); every layer sparse. No load-balancing loss: the warm start is the dense one's.
LAB_MOE_CONFIG: dict[str, Any] = {**LAB_CONFIG, "num_experts": 8, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 128, "norm_topk_prob": True}

_LAB_TASK = {"length": 32, "period": 4}
_LAB_WARM = WarmStartRecipe(steps=200, batch_size=64, lr=3e-3, context_noise=0.5, calibration_steps=80,
                            smoothing=0.85)

RECIPES: dict[str, ModelRecipe] = {
    "tiny": ModelRecipe("tiny"),
    "lab": ModelRecipe(
        "lab",
        config=LAB_CONFIG,
        task_name="pattern",
        task_args=_LAB_TASK,
        warm=_LAB_WARM,
    ),
    "lab-moe": ModelRecipe("lab-moe", config=LAB_MOE_CONFIG, architecture="qwen3_moe", task_name="pattern",
                           task_args=_LAB_TASK, warm=_LAB_WARM),
}


def get_recipe(name: str | ModelRecipe) -> ModelRecipe:
    """A recipe by name (``ValueError`` listing the known ones), or the recipe itself."""
    if isinstance(name, ModelRecipe):
        return name
    if name not in RECIPES:
        raise ValueError(f"unknown embedded model {name!r}: use one of {sorted(RECIPES)}")
    return RECIPES[name]
