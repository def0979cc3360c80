"""The built-in log-prob transforms, described in :data:`offpolicy.registry.TRANSFORMS`: their parameters, what each
needs from the host, and :func:`apply_transforms`, the one function every host runs them through on the batch.

A transform has up to two stages. The *forward* stage reads the logits (DVP's and sampling replay's support, score
centering's centre, top-K TRM's bounds), so the host's scoring computes it with the fused kernels and writes what it
found into the batch's ``extras`` under the names of :func:`forward_extras`. The *batch* stage —
:func:`apply_transforms` — then finishes each transform on the :class:`~offpolicy.LogProbBatch`: a built-in's
``on_batch`` (the centre put into the log-probs' gradient, the bound TRM reads chosen) or a plug-in's ``apply``, in
order. A plug-in is one file and one test: it runs in every host that calls :func:`apply_transforms` and can supply
what it needs (:func:`offpolicy.recipe.hosts.check_host` refuses it in one line naming the missing input).

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

Stages: ``dvp`` / ``sampling_replay`` — forward (the replayed log-probs, ``dvp_keep`` / ``dvp_mass``); ``alp`` —
forward (the noise hooks); ``exact_kl`` — forward (``token_divergence`` from the full logits); ``proximal`` — the
objective (:func:`offpolicy.policy_loss` puts π_prox in ``old_logp``); ``score_centering`` and ``topk_bounds`` —
forward, then batch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from offpolicy.registry import REQUIRED, BoundTransform, Transform, build_transform, describe_transform

if TYPE_CHECKING:
    from torch import Tensor

    from offpolicy.batch import LogProbBatch

__all__ = ["BUILTIN_TRANSFORMS", "FetchPlan", "apply_transforms", "fetch_plan", "forward_extras"]

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


# -- what a host fetches from its engine, from the transforms' needs ----------------------------------------------------


@dataclass(frozen=True)
class FetchPlan:
    """What a run's transforms need a host to fetch besides π_θ (keys of :data:`offpolicy.registry.NEEDS`):
    ``topk`` — the engine's top-K log-probs per sampled token (K; 0: none), ``logits`` — its full logits,
    ``versions`` — per-token policy versions, ``hidden_states`` — hooks on the decoder layers, ``sampling_recipe``
    — the engine's sampling recipe on both sides."""

    topk: int = 0
    logits: bool = False
    versions: bool = False
    hidden_states: bool = False
    sampling_recipe: bool = False


def fetch_plan(transforms: Sequence[BoundTransform | str | Mapping[str, Any]]) -> FetchPlan:
    """The :class:`FetchPlan` of ``transforms``, read off each one's ``needs`` (never its name): a transform that
    needs ``engine_topk`` says how many with its parameter ``k``; two that ask for different K are refused (the
    engine reports one top-K per token).

    >>> fetch_plan([{"name": "topk_bounds", "k": 8}, {"name": "score_centering", "source": "topk", "k": 8}, "alp"])
    FetchPlan(topk=8, logits=False, versions=False, hidden_states=True, sampling_recipe=False)
    >>> fetch_plan([{"name": "topk_bounds", "k": 8}, {"name": "score_centering", "source": "topk"}])
    Traceback (most recent call last):
    ...
    ValueError: transforms.score_centering.k=20 and transforms.topk_bounds.k=8: the engine reports one top-K per token; make them equal
    """
    bound = [t if isinstance(t, BoundTransform) else build_transform(t) for t in transforms]
    ks: dict[str, int] = {}
    for t in bound:
        if "engine_topk" in t.needs:
            if not isinstance(t.params.get("k"), int):
                raise ValueError(f"transform {t.name!r} needs engine_topk but has no int parameter 'k' (how many "
                                 "log-probs per token to fetch)")
            ks[t.name] = t.params["k"]
    if len(set(ks.values())) > 1:
        named = " and ".join(f"transforms.{n}.k={k}" for n, k in sorted(ks.items()))
        raise ValueError(f"{named}: the engine reports one top-K per token; make them equal")
    needs = {n for t in bound for n in t.needs}
    return FetchPlan(topk=next(iter(ks.values()), 0), logits="engine_logits" in needs,
                     versions="policy_versions" in needs, hidden_states="hidden_states" in needs,
                     sampling_recipe="sampling_recipe" in needs)


# -- the forward stage's results, by name (what a host's scoring writes into LogProbBatch.extras) ----------------------

SCORE_CENTER = "score_centering.center"  # c [B, T]: score centering's centre, differentiable
TOPK_KL_LOWER = "topk_bounds.kl_lower"  # [B, T]: KL(μ‖π) bounds from the engine's top-K (no gradient)
TOPK_KL_UPPER = "topk_bounds.kl_upper"
ENGINE_TOPK_LOGP = "engine_topk.logp"  # [B, T, K]: the engine's top-K log-probs at each sampled position (engine_topk)
ENGINE_TOPK_IDS = "engine_topk.ids"  # [B, T, K]: their token ids


def forward_extras(*, keep: Tensor | None = None, mass: Tensor | None = None, center: Tensor | None = None,
                   kl_lower: Tensor | None = None, kl_upper: Tensor | None = None,
                   topk: tuple[Tensor, Tensor] | None = None) -> dict[str, Tensor]:
    """The ``extras`` of a scoring forward's results, each ``[B, T]`` (None: not computed): DVP's / sampling
    replay's ``keep`` (the sampled token inside the trainer's support) and ``mass`` (the support's retained mass),
    score centering's ``center``, top-K TRM's ``kl_lower`` / ``kl_upper``; and the engine's top-K
    ``(log-probs, ids)`` ``[B, T, K]`` as fetched, for a transform that needs ``engine_topk``
    (``extras["engine_topk.logp"]``, ``extras["engine_topk.ids"]``).

    >>> import torch
    >>> sorted(forward_extras(keep=torch.ones(1, 2, dtype=torch.bool), center=torch.zeros(1, 2)))
    ['dvp_keep', 'score_centering.center']
    """
    named = {"dvp_keep": keep, "dvp_mass": mass, SCORE_CENTER: center, TOPK_KL_LOWER: kl_lower,
             TOPK_KL_UPPER: kl_upper, ENGINE_TOPK_LOGP: None if topk is None else topk[0],
             ENGINE_TOPK_IDS: None if topk is None else topk[1]}
    return {k: v for k, v in named.items() if v is not None}


def _without(extras: Mapping[str, Tensor], *keys: str) -> dict[str, Tensor]:
    return {k: v for k, v in extras.items() if k not in keys}


def center_on_batch(batch: LogProbBatch, **params: Any) -> LogProbBatch:
    """Score centering's batch step (arXiv 2609.20807): ``logp`` ``[B, T]`` carrying the centred score
    ∇log π_θ(y) − E_q[∇log π_θ] as its gradient, value unchanged — ``logp − c + sg(c)`` with the forward's centre
    ``c`` (``extras["score_centering.center"]``, removed). A batch whose forward computed no centre (no engine
    top-K in it) is returned as is. ``params``: the transform's (read by the forward stage).

    >>> import torch
    >>> z = torch.zeros(2, requires_grad=True)                      # p = (½, ½), y = token 0
    >>> logp = torch.log_softmax(z, -1)[:1].reshape(1, 1)
    >>> c = (torch.tensor([0.9, 0.1]) * torch.log_softmax(z, -1)).sum().reshape(1, 1)   # q = (0.9, 0.1)
    >>> from offpolicy.batch import LogProbBatch
    >>> b = center_on_batch(LogProbBatch(logp=logp, mask=torch.ones(1, 1), extras={SCORE_CENTER: c}))
    >>> b.logp.item() == logp.item(), torch.autograd.grad(b.logp.sum(), z)[0], b.extras
    (True, tensor([ 0.1000, -0.1000]), {})
    """
    from offpolicy.objectives.score_centering import centered_logp

    center = batch.extras.get(SCORE_CENTER)
    if center is None:
        return batch
    return batch.replace(logp=centered_logp(batch.logp, center.to(batch.logp.dtype)),
                         extras=_without(batch.extras, SCORE_CENTER))


def topk_on_batch(batch: LogProbBatch, *, bound: str = "upper", **params: Any) -> LogProbBatch:
    """Top-K TRM's batch step: ``token_divergence`` ``[B, T]`` = the forward's certified upper bound on KL(μ‖π_old)
    (``bound="upper"``) or its lower bound, read from the top-K (``token_divergence_kind="topk"``); the two
    bounds leave ``extras``. A batch whose forward computed no bounds is returned as is.

    >>> import torch
    >>> from offpolicy.batch import LogProbBatch
    >>> b = LogProbBatch(logp=torch.zeros(1, 2), mask=torch.ones(1, 2),
    ...                  extras={TOPK_KL_LOWER: torch.tensor([[0.1, 0.2]]), TOPK_KL_UPPER: torch.tensor([[0.3, 0.4]])})
    >>> out = topk_on_batch(b, bound="lower")
    >>> out.token_divergence, out.token_divergence_kind, out.extras
    (tensor([[0.1000, 0.2000]]), 'topk', {})
    """
    upper, lower = batch.extras.get(TOPK_KL_UPPER), batch.extras.get(TOPK_KL_LOWER)
    if upper is None or lower is None:
        return batch
    return batch.replace(token_divergence=upper if bound == "upper" else lower, token_divergence_kind="topk",
                         extras=_without(batch.extras, TOPK_KL_UPPER, TOPK_KL_LOWER))


def apply_transforms(batch: LogProbBatch,
                     transforms: Sequence[BoundTransform | str | Mapping[str, Any]]) -> LogProbBatch:
    """The batch stage of every transform, in order: each built-in's ``on_batch`` and each plug-in's ``apply``
    (``(batch, **params) -> LogProbBatch``); a transform whose work is all in the forward or the objective passes
    the batch on. ``transforms``: bound transforms or specs (:func:`offpolicy.build_transform`). What a host
    calls between its scoring and :func:`offpolicy.policy_loss`.

    >>> import torch
    >>> from offpolicy.batch import LogProbBatch
    >>> b = LogProbBatch(logp=torch.zeros(1, 1), mask=torch.ones(1, 1), extras={TOPK_KL_LOWER: torch.ones(1, 1),
    ...                  TOPK_KL_UPPER: torch.full((1, 1), 2.0)})
    >>> apply_transforms(b, ["dvp", {"name": "topk_bounds", "k": 4}]).token_divergence
    tensor([[2.]])
    """
    from offpolicy.batch import LogProbBatch

    for spec in transforms:
        t = spec if isinstance(spec, BoundTransform) else build_transform(spec)
        step = t.entry.apply if t.entry.apply is not None else t.entry.on_batch
        if step is None:
            continue
        out = step(batch, **t.params)
        if not isinstance(out, LogProbBatch):
            raise ValueError(f"transform {t.name!r}: must return a LogProbBatch (batch.replace(...)), got "
                             f"{type(out).__name__}")
        batch = out
    return batch


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
              check=_check_centering, on_batch=center_on_batch),
    Transform("proximal", {"method": "recompute"}, _proximal_needs, "old_logp",
              "decoupled PPO's π_prox: the trainer's forward (recompute) or AReaL's log-linear interpolation between "
              "μ and π_θ by per-token policy versions (loglinear)", check=_check_proximal),
    Transform("alp", {"init_std": 1e-4, "lr": 5e-4, "layers": "all", "layers_path": None, "seed": None,
                      "level": "token"}, ("hidden_states",), "logp",
              "adaptive layerwise perturbation: learnable noise in the update forward, unified ratio π_{θ,σ}/μ "
              "(arXiv 2603.19470)", check=_check_alp),
    Transform("topk_bounds", {"k": REQUIRED, "bound": "upper"}, ("engine_topk",), "token_divergence",
              "TRM's per-token KL(μ‖π_old) bounded from the engine's top-K log-probs (upper: certified)",
              check=_check_topk, on_batch=topk_on_batch),
    Transform("exact_kl", {}, ("engine_logits",), "token_divergence",
              "TRM's per-token KL(μ‖π_old), exact from the engine's full logits"),
)

for _entry in BUILTIN_TRANSFORMS:
    describe_transform(_entry)
