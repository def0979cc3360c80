"""The proximal policy of decoupled PPO without its forward: AReaL's log-linear approximation from policy versions.

The decoupled PPO objective (arXiv 2110.00641, eq. 5) reads three policies: the behaviour policy μ that sampled
(``rollout_logp``), the proximal policy π_prox that anchors the clip (``old_logp``, one extra forward of the trainer
per step) and π_θ.
AReaL's ``prox_logp_method: loglinear`` skips that forward: each token carries the version v_behave of the weights
that generated it, the trainer is at version v_θ, and π_prox — one version behind, v_prox = v_θ − 1 — is placed on
the straight line between log μ and log π_θ by version:

    α = (v_prox − v_behave) / (v_θ − v_behave),   clamped to [0, 1]
    log π_prox ≈ log μ + α · (sg(log π_θ) − log μ)

α is 0 where v_θ ≤ v_behave (nothing to interpolate: π_prox = μ) and where v_behave < 0 (a token without a version,
AReaL's prompt tokens); a one-step-stale token (v_behave = v_prox) also gets α = 0, a k-step-stale one (k − 1)/k.
The approximation is detached, as AReaL computes it from ``logprobs.detach()``.

Source: AReaL ``areal/trainer/ppo/actor.py::compute_prox_logp_approximations`` (method ``loglinear``) and
``_resolve_proximal_logp`` (refuses a batch without versions); docs/en/algorithms/prox_approx.md reports 1.27× faster
training on GSM8K (Qwen2.5-1.5B, staleness 8) at a 0.937 vs 0.954 task reward.

Use: ``policy_loss(batch, objective={"name": "decoupled", "proximal": "loglinear"})`` with ``batch.versions``
``[B, T]`` and ``batch.policy_version`` set: :func:`approximate_proximal` replaces ``batch.old_logp`` by the
approximation before any correction reads it, so a correction's π_old/μ is AReaL's behaviour weight π_prox/μ.
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch

PROXIMAL_METHODS = ("recompute", "loglinear")


def check_proximal(proximal: object) -> str:
    """One of :data:`PROXIMAL_METHODS`."""
    if proximal not in PROXIMAL_METHODS:
        raise ValueError(f"proximal must be one of {PROXIMAL_METHODS}, got {proximal!r}")
    return str(proximal)


def loglinear_alpha(versions: Tensor, policy_version: int) -> Tensor:
    """α ``[B, T]`` float32 from the tokens' versions v_behave ``[B, T]`` (integer; < 0 = no version) and the
    trainer's version v_θ, with v_prox = v_θ − 1 (module docstring).

    >>> loglinear_alpha(torch.tensor([[5, 4, 3, 1, 6, -1]]), 5)   # fresh, 1-, 2-, 4-step stale, ahead, no version
    tensor([[0.0000, 0.0000, 0.5000, 0.7500, 0.0000, 0.0000]])
    """
    if not isinstance(versions, Tensor) or versions.is_floating_point() or versions.dtype == torch.bool:
        raise ValueError(f"versions must be an integer tensor, got {getattr(versions, 'dtype', type(versions))}")
    if isinstance(policy_version, bool) or not isinstance(policy_version, int):
        raise ValueError(f"policy_version must be an int, got {policy_version!r}")
    v_behave = versions.double()  # exact for any realistic version count
    gap = (policy_version - 1) - v_behave
    diff = policy_version - v_behave
    alpha = torch.where((diff > 0) & (versions >= 0), gap / diff.clamp(min=1.0), 0.0)
    return alpha.clamp(0.0, 1.0).float()


def loglinear_proximal_logp(logp: Tensor, rollout_logp: Tensor, versions: Tensor, policy_version: int) -> Tensor:
    """log π_prox ≈ log μ + α (sg(log π_θ) − log μ) ``[B, T]`` float32, detached (module docstring).

    >>> loglinear_proximal_logp(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-2.0, -2.0]]), torch.tensor([[3, 4]]), 5)
    tensor([[-1.5000, -2.0000]])
    """
    alpha = loglinear_alpha(versions, policy_version)
    mu = rollout_logp.detach().float()
    return mu + alpha * (logp.detach().float() - mu)


def approximate_proximal(batch: LogProbBatch) -> LogProbBatch:
    """The batch with ``old_logp`` = AReaL's log-linear π_prox; refuses a batch without what it needs.

    >>> b = LogProbBatch(logp=torch.zeros(1, 2), mask=torch.ones(1, 2), rollout_logp=torch.full((1, 2), -1.0),
    ...                  versions=torch.tensor([[2, 3]]), policy_version=4)
    >>> approximate_proximal(b).old_logp   # α = (½, 0)
    tensor([[-0.5000, -1.0000]])
    >>> approximate_proximal(b.replace(versions=None))
    Traceback (most recent call last):
    ...
    ValueError: versions: proximal='loglinear' needs the per-token policy versions (batch.versions); the batch has none
    """
    if batch.versions is None:
        raise ValueError("versions: proximal='loglinear' needs the per-token policy versions (batch.versions); "
                         "the batch has none")
    if batch.policy_version is None:
        raise ValueError("policy_version: proximal='loglinear' needs the trainer's policy version "
                         "(batch.policy_version); the batch has none")
    if batch.rollout_logp is None:
        raise ValueError("rollout_logp: proximal='loglinear' interpolates from μ (the rollout engine's log-probs); "
                         "the batch has none")
    return batch.replace(old_logp=loglinear_proximal_logp(batch.logp, batch.rollout_logp, batch.versions,
                                                          batch.policy_version))
