"""Decoupled PPO's proximal policy in the reference trainer: the forward (``recompute``) or AReaL's log-linear
approximation from policy versions (``loglinear``, :mod:`offpolicy.objectives.proximal`), which skips the forward.

``algorithm.proximal=loglinear`` (with ``algorithm.objective=decoupled``; or the objective's own
``{name: decoupled, proximal: loglinear}``) changes three things in a step:

1. rollout — each sampled token carries the version of the engine's weights: the trainer's version at the engine's
   last weight sync (``rollout.sync_every = k``: an engine synced at step s₀ samples at steps s₀ … s₀ + k − 1 with
   version s₀), ``-1`` on padding (:func:`token_versions`);
2. scoring — no π_prox forward: the mask comes from the completions' lengths (:func:`completion_mask`), a rollout
   without versions is refused;
3. update — each minibatch's :class:`~offpolicy.LogProbBatch` carries the versions and the trainer's version v_θ
   (completed steps: AReaL's ``engine.get_version()`` during its update), and :func:`offpolicy.policy_loss` puts
   log π_prox ≈ log μ + α (sg(log π_θ) − log μ), α = clamp((v_θ − 1 − v_behave) / (v_θ − v_behave), 0, 1), in
   ``old_logp`` before the correction chain reads it.

So a token sampled d steps ago gets α = (d − 1)/d: fresh and one-step-stale tokens get π_prox = μ exactly (AReaL's
v_prox = v_θ − 1), whatever numerics the engine had. The step's π_old diagnostics (``rollout_correction/*``, the
controllers) then read the approximation the loss used on each row in the first epoch, not a measured π_old: with
loglinear nothing measures the engine's numerical mismatch.

Versions count the trainer's steps (one rollout batch and its ``optim.minibatches × optim.epochs`` optimiser
steps), as AReaL counts its train steps. What the trainer saves: one no-grad forward over the batch per step (none in
the single pass, where that forward is π_θ's own, :func:`offpolicy.train.steps.single_pass`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.objectives.proximal import loglinear_proximal_logp

# what the π_prox forward computes besides π_old, by the setting that needs it: refused with loglinear
_NEEDS_FORWARD = {
    "divergence": "the exact KL(μ‖π_old) from π_old's logits",
    "minp": "DVP's min-p constrained π_old and its safe set",
    "score_centering": "the sampler's distribution scored beside π_old's logits",
}


def proximal_method(objective_params: dict[str, Any]) -> str:
    """``"loglinear"`` or ``"recompute"``: the objective's ``proximal`` parameter (absent: recompute)."""
    return str(objective_params.get("proximal", "recompute"))


def check_loglinear(cfg: Any, objective_params: dict[str, Any]) -> None:
    """Refuse a config where ``loglinear`` cannot skip the π_prox forward (a ``ValueError`` naming the setting)."""
    if proximal_method(objective_params) != "loglinear":
        return
    from offpolicy.train.presets import PRESETS

    preset = PRESETS[cfg.algorithm.preset]
    for attribute, what in _NEEDS_FORWARD.items():
        if getattr(preset, attribute):
            raise ValueError(f"algorithm.proximal=loglinear skips the trainer's π_prox forward, but preset "
                             f"{preset.name!r} needs {what}; use algorithm.proximal=recompute")
    if cfg.rollout.routing_replay == "r2":
        raise ValueError("algorithm.proximal=loglinear skips the trainer's π_prox forward, whose routes "
                         "rollout.routing_replay=r2 replays; use r3 or algorithm.proximal=recompute")


def completion_mask(completions: list[list[int]], like: Tensor) -> Tensor:
    """``[B, T]`` bool, True on each row's completion tokens (``like``: the rollout's ``[B, T]`` log-probs) — the mask
    the scoring forward returns (:func:`offpolicy.rollout.scoring.score_tokens`), without the forward.

    >>> completion_mask([[5, 6, 7], [8]], torch.zeros(2, 3))
    tensor([[ True,  True,  True],
            [ True, False, False]])
    """
    lengths = torch.tensor([len(c) for c in completions], device=like.device)
    if lengths.numel() != like.shape[0]:
        raise ValueError(f"completions has {lengths.numel()} rows but rollout_logp has {like.shape[0]}")
    return torch.arange(like.shape[1], device=like.device)[None, :] < lengths[:, None]


def token_versions(completions: list[list[int]], like: Tensor, version: int) -> Tensor:
    """``[B, T]`` int64: ``version`` (the engine's weights version at sampling) on every sampled token, −1 (no
    version: AReaL's prompt tokens) on padding.

    >>> token_versions([[5, 6], [8]], torch.zeros(2, 2), 3)
    tensor([[ 3,  3],
            [ 3, -1]])
    """
    mask = completion_mask(completions, like)
    return torch.where(mask, torch.full_like(mask, version, dtype=torch.long), -1)


def unscored_mask(completions: list[list[int]], rollout_logp: Tensor, versions: Tensor | None) -> Tensor:
    """The scoring step's mask under loglinear; a rollout without per-token versions is refused."""
    if versions is None:
        raise ValueError("versions: algorithm.proximal=loglinear needs the per-token policy versions of each rollout "
                         "(Rollout.versions); this rollout has none")
    if versions.shape != rollout_logp.shape:
        raise ValueError(f"versions has shape {tuple(versions.shape)} but rollout_logp has shape "
                         f"{tuple(rollout_logp.shape)}; they must match")
    return completion_mask(completions, rollout_logp)


def with_versions(batch: LogProbBatch, versions: Tensor, policy_version: int,
                  record: Tensor | None = None, rows: Tensor | None = None) -> LogProbBatch:
    """A minibatch's batch for loglinear: ``versions`` ``[B, T']`` (cut to the batch's T), v_θ, no ``old_logp``
    (:func:`offpolicy.policy_loss` computes π_prox). With ``record`` (the step's ``[N, T']`` π_old diagnostics) and
    ``rows``, the approximation this minibatch's loss reads is written there for the step's metrics.

    >>> b = LogProbBatch(logp=torch.zeros(1, 2), mask=torch.ones(1, 2), old_logp=torch.zeros(1, 2),
    ...                  rollout_logp=torch.full((1, 2), -1.0))
    >>> with_versions(b, torch.tensor([[2, 3, -1]]), 4).versions, with_versions(b, torch.tensor([[2, 3]]), 4).old_logp
    (tensor([[2, 3]]), None)
    """
    cut = versions[:, : batch.seq_len].to(batch.logp.device)
    out = batch.replace(versions=cut, policy_version=policy_version, old_logp=None)
    if record is not None and rows is not None and out.rollout_logp is not None:
        prox = loglinear_proximal_logp(out.logp, out.rollout_logp, cut, policy_version)
        record[rows.to(record.device), : batch.seq_len] = prox.to(record.dtype)
    return out


def resumed_versions(start: int, sync_every: int) -> tuple[int, int]:
    """``(trainer version, engine version)`` of a run resumed at step ``start`` (0-based) whose engine syncs at every
    step divisible by ``sync_every``.

    >>> resumed_versions(10, 4)
    (10, 8)
    """
    return start, start - start % sync_every
