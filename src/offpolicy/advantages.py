"""Group-relative advantages from per-sequence rewards: GRPO, Dr.GRPO, RLOO.

Rewards are a [B] tensor whose groups are consecutive blocks of ``group_size`` (the G completions of one prompt sit
next to each other, as GRPO samplers lay them out). Outputs are [B] float32 advantages, one per sequence; broadcast
them to tokens with :func:`offpolicy.batch.token_advantages` (or put them straight into a ``LogProbBatch``).

* GRPO (DeepSeekMath, arXiv 2402.03300, §4.1.2): A_i = (r_i − mean_g r) / (std_g r + eps); std is the unbiased
  (Bessel-corrected) group std, as in TRL and verl (torch.std); group_size 1 gives A = 0.
* Dr.GRPO (arXiv 2503.20783, §3.2): A_i = r_i − mean_g r — no std division (it biases towards easy/hard prompts).
* RLOO (Ahmadian et al. 2024, arXiv 2402.14740; Kool et al. 2019): A_i = r_i − mean_{j≠i} r_j
  = G/(G−1) · (r_i − mean_g r); needs group_size ≥ 2.

Non-finite rewards raise ``ValueError`` in eager mode. Under ``torch.compile`` that content check is skipped (it would
need a host sync / graph break); validate rewards before compiling if they can be NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _grouped(rewards: Tensor, group_size: int, *, min_group: int = 1) -> Tensor:
    if not isinstance(rewards, Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < min_group:
        raise ValueError(f"group_size must be an int >= {min_group}, got {group_size!r}")
    if rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"group_size={group_size} does not divide the number of rewards B={rewards.shape[0]}; "
            "groups are consecutive blocks of group_size"
        )
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or ±inf; every completion needs a finite reward")
    # float64: a group's mean and spread are taken exactly enough that standardising a near-constant group
    # (1.7480, 1.7480, 1.7481) still gives advantages that sum to 0; [B] values, so the cost is nothing
    return rewards.double().view(-1, group_size)


def grpo_advantages(rewards: Tensor, group_size: int, *, eps: float = 1e-6, std_normalize: bool = True) -> Tensor:
    """GRPO advantages [B]: (r − group mean) / (group std + eps) (DeepSeekMath §4.1.2, outcome supervision).

    Args:
        rewards: [B] per-sequence rewards, groups = consecutive blocks of ``group_size``.
        group_size: G completions per prompt (B % G == 0).
        eps: added to the std so constant-reward groups give 0, not NaN.
        std_normalize: False gives Dr.GRPO (:func:`dr_grpo_advantages`).

    >>> grpo_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), group_size=2)   # std of (1, 0) = 0.7071
    tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """
    g = _grouped(rewards, group_size)
    # A group of equal rewards carries no signal: A = 0 exactly (a mean one ulp off the common value, divided by a
    # std of the same size plus eps = 1e-6, gave every completion ±0.3 in float32).
    constant = g.amax(dim=-1, keepdim=True) == g.amin(dim=-1, keepdim=True)
    centred = torch.where(constant, torch.zeros_like(g), g - g.mean(dim=-1, keepdim=True))
    if std_normalize:
        if group_size == 1:
            centred = torch.zeros_like(centred)  # a single completion has no spread: std is undefined, A = 0
        else:
            centred = centred / (g.std(dim=-1, keepdim=True) + eps)
    return centred.reshape(-1).float()


def dr_grpo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Dr.GRPO advantages [B]: r − group mean, no std normalisation (arXiv 2503.20783 §3.2).

    >>> dr_grpo_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), group_size=2)
    tensor([ 0.5000, -0.5000,  1.0000, -1.0000])
    """
    return grpo_advantages(rewards, group_size, std_normalize=False)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO advantages [B]: r_i − mean of the *other* G−1 rewards of the group (arXiv 2402.14740, eq. 6).

    >>> rloo_advantages(torch.tensor([1.0, 0.0, 0.0]), group_size=3)   # 1 − (0+0)/2, 0 − (1+0)/2, 0 − (1+0)/2
    tensor([ 1.0000, -0.5000, -0.5000])
    """
    g = _grouped(rewards, group_size, min_group=2)
    others = (g.sum(dim=-1, keepdim=True) - g) / (group_size - 1)
    return (g - others).reshape(-1).float()
