"""The built-in log-prob transforms, described in :data:`offpolicy.registry.TRANSFORMS`: their parameters and what
each needs from the host. Each host still computes them in its own scoring (the reference trainer, TRL's and verl's
adapters); this module is the one place that says what they take and read, so a :class:`~offpolicy.Recipe` names
them with one spelling and a host can refuse one whose inputs it cannot supply.

==================  =========================================================  =================================
transform           parameters                                                 needs
==================  =========================================================  =================================
``dvp``             ``rho`` (e^-13), ``coverage`` (None) — arXiv 2512.23087     sampling_recipe
``sampling_replay`` ``top_k``, ``top_p``, ``min_p`` (None: the host's own)     sampling_recipe
``score_centering`` ``source`` (exact | topk), ``k`` (20), ``weighting``       engine_logits (exact) /
                    (None | tis | icepop | replay) — arXiv 2609.20807          engine_topk (topk); rollout_logp
                                                                               with a weighting
``proximal``        ``method`` (recompute | loglinear) — π_prox (AReaL)        old_logp / policy_versions +
                                                                               rollout_logp
``alp``             ``init_std``, ``lr``, ``layers``, ``layers_path``,         hidden_states
                    ``seed``, ``level`` — arXiv 2603.19470
``topk_bounds``     ``k``, ``bound`` (upper | lower): TRM's KL from the top-K  engine_topk
``exact_kl``        none: TRM's KL(μ‖π_old) from the engine's full logits      engine_logits
==================  =========================================================  =================================

>>> from offpolicy.registry import build_transform
>>> build_transform({"name": "score_centering", "source": "topk"}).needs
('engine_topk',)
>>> build_transform({"name": "proximal", "method": "loglinear"}).needs
('policy_versions', 'rollout_logp')
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from offpolicy.registry import REQUIRED, Transform, describe_transform

__all__ = ["BUILTIN_TRANSFORMS"]

DVP_RHO = math.exp(-13)  # the paper's ρ (offpolicy.corrections.vocabulary.DEFAULT_RHO)
SCORE_CENTERING_K = 20  # vLLM's default max_logprobs


def _real(name: str, key: str, value: Any, low: float, high: float, *, closed_low: bool = False,
          allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    x = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    if not math.isfinite(x) or not ((low <= x if closed_low else low < x) and x <= high):
        bracket = "[" if closed_low else "("
        raise ValueError(f"transform {name!r}: {key} must be a real number in {bracket}{low}, {high}], got {value!r}")


def _int(name: str, key: str, value: Any, low: int, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"transform {name!r}: {key} must be an int >= {low}, got {value!r}")


def _choice(name: str, key: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(f"transform {name!r}: {key} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_dvp(p: Mapping[str, Any]) -> None:
    _real("dvp", "rho", p["rho"], 0.0, 1.0)
    _real("dvp", "coverage", p["coverage"], 0.0, 1.0, allow_none=True)


def _check_replay(p: Mapping[str, Any]) -> None:
    _int("sampling_replay", "top_k", p["top_k"], 1, allow_none=True)
    _real("sampling_replay", "top_p", p["top_p"], 0.0, 1.0, allow_none=True)
    _real("sampling_replay", "min_p", p["min_p"], 0.0, 1.0, allow_none=True)


def _check_centering(p: Mapping[str, Any]) -> None:
    _choice("score_centering", "source", p["source"], ("exact", "topk"))
    _int("score_centering", "k", p["k"], 1)
    _choice("score_centering", "weighting", p["weighting"], (None, "tis", "icepop", "replay"))
    if p["weighting"] is not None and p["source"] != "topk":
        raise ValueError("transform 'score_centering': weighting applies to source 'topk' (NeMo-RL's coefficients on "
                         "the engine's top-K)")


def _centering_needs(p: Mapping[str, Any]) -> tuple[str, ...]:
    head = ("engine_logits",) if p["source"] == "exact" else ("engine_topk",)
    return head + (("rollout_logp",) if p["weighting"] is not None else ())


def _check_proximal(p: Mapping[str, Any]) -> None:
    _choice("proximal", "method", p["method"], ("recompute", "loglinear"))


def _proximal_needs(p: Mapping[str, Any]) -> tuple[str, ...]:
    return ("policy_versions", "rollout_logp") if p["method"] == "loglinear" else ("old_logp",)


def _check_alp(p: Mapping[str, Any]) -> None:
    _real("alp", "init_std", p["init_std"], 0.0, 10.0)
    _real("alp", "lr", p["lr"], 0.0, 10.0)
    layers = p["layers"]
    if layers not in ("all", "logits") and not (isinstance(layers, (list, tuple)) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        raise ValueError(f"transform 'alp': layers must be 'all', 'logits' or a list of layer indices, got {layers!r}")
    _int("alp", "seed", p["seed"], 0, allow_none=True)
    _choice("alp", "level", p["level"], ("token", "geometric", "sequence"))
    if p["layers_path"] is not None and not isinstance(p["layers_path"], str):
        raise ValueError(f"transform 'alp': layers_path must be text, got {p['layers_path']!r}")


def _check_topk(p: Mapping[str, Any]) -> None:
    _int("topk_bounds", "k", p["k"], 1)
    _choice("topk_bounds", "bound", p["bound"], ("upper", "lower"))


BUILTIN_TRANSFORMS: tuple[Transform, ...] = (
    Transform("dvp", {"rho": DVP_RHO, "coverage": None}, ("sampling_recipe",), "logp",
              "dynamic vocabulary pruning: π_θ, π_old and μ on the min-p(ρ) safe set (arXiv 2512.23087); coverage: "
              "the entropy-adaptive top-p(1 − ε) ∩ min-p(ρ) set", ("dvp_keep",), check=_check_dvp),
    Transform("sampling_replay", {"top_k": None, "top_p": None, "min_p": None}, ("sampling_recipe",), "logp",
              "every forward scores under the engine's truncation (min-p, top-k, top-p, in vLLM's order); None: the "
              "host's own sampling settings", ("dvp_keep",), check=_check_replay),
    Transform("score_centering", {"source": "exact", "k": SCORE_CENTERING_K, "weighting": None}, _centering_needs,
              "logp", "the score ∇log π_θ(y) − E_q[∇log π_θ] centred on the sampler's distribution q (arXiv "
              "2609.20807): its full logits (exact) or top-K head with the proportional tail (topk)",
              check=_check_centering),
    Transform("proximal", {"method": "recompute"}, _proximal_needs, "old_logp",
              "decoupled PPO's π_prox: the trainer's forward (recompute) or AReaL's log-linear interpolation between "
              "μ and π_θ by per-token policy versions (loglinear)", check=_check_proximal),
    Transform("alp", {"init_std": 1e-4, "lr": 5e-4, "layers": "all", "layers_path": None, "seed": None,
                      "level": "token"}, ("hidden_states",), "logp",
              "adaptive layerwise perturbation: learnable noise in the update forward, unified ratio π_{θ,σ}/μ "
              "(arXiv 2603.19470)", check=_check_alp),
    Transform("topk_bounds", {"k": REQUIRED, "bound": "upper"}, ("engine_topk",), "token_divergence",
              "TRM's per-token KL(μ‖π_old) bounded from the engine's top-K log-probs (upper: certified)",
              check=_check_topk),
    Transform("exact_kl", {}, ("engine_logits",), "token_divergence",
              "TRM's per-token KL(μ‖π_old), exact from the engine's full logits"),
)

for _entry in BUILTIN_TRANSFORMS:
    describe_transform(_entry)
