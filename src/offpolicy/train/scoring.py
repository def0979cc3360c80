"""The trainer's log-probs of sampled tokens (π_old's scoring forward and π_θ's in the update), DVP's constrained
variants (through :func:`offpolicy.forward_scores.token_scores`, the function every host's scoring calls), and the
exact token KL between the engine's and the trainer's logits.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from offpolicy.rollout.sampling import TRUNCATION_ORDER, SamplingConfig, process_logits
from offpolicy.rollout.scoring import sequence_logprobs


def score_policy(model: torch.nn.Module, prompt_ids: list[list[int]], completions: list[list[int]],
                 sampling: SamplingConfig, *, dtype: torch.dtype, dvp_rho: float | None = None,
                 return_logits: bool = False) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
    """The trainer's log-probs ``[B, T]`` of the sampled tokens: ``(logp, mask, raw logits | None, extras)``.

    Plain: processed exactly like the engine (temperature, top-k/p, min-p). DVP (``dvp_rho``): log π over the
    trainer's own safe set V_S — min-p(ρ) at the sampling temperature (arXiv 2512.23087 Def 5.2), or with
    ``algorithm.dvp_coverage`` (``sampling`` carries top-p = 1 − ε and min-p = ρ) the entropy-adaptive
    V_S = top-p(1 − ε) ∩ min-p(ρ) of the whole recipe — read off the forward's logits by
    :func:`~offpolicy.forward_scores.token_scores`, as TRL's and verl's DVP are. ``extras["dvp_keep"]``: the sampled
    token is inside V_S (DVP's ratio is 0 otherwise; its log-prob is a finite 0 there); ``extras["dvp_mass"]``: the
    retained mass Z (Prop. 5.5 bounds the bias by R·T·(1 − Z_min)).
    """
    if dvp_rho is None:
        out = sequence_logprobs(model, prompt_ids, completions, sampling, dtype=dtype, return_logits=return_logits)
        return out[0], out[1], (out[2] if return_logits else None), {}
    from offpolicy.rollout.base import pad_ids

    adaptive = sampling.top_p is not None
    safe_set = sampling if adaptive else SamplingConfig(temperature=sampling.temperature, min_p=dvp_rho)
    # the forward only needs the raw logits (no recipe: its processed log-probs would be thrown away); the safe set
    # is applied once, below
    _, mask, logits = sequence_logprobs(model, prompt_ids, completions, None, dtype=dtype, return_logits=True)
    targets = pad_ids(completions, 0, side="right")[0].to(logits.device)[:, : mask.shape[1]]
    logp, keep, mass = dvp_scores(logits, targets, safe_set)
    keep = keep & mask
    return torch.where(keep, logp, torch.zeros_like(logp)), mask, (logits if return_logits else None), \
        {"dvp_keep": keep, "dvp_mass": mass}


def dvp_scores(logits: Tensor, targets: Tensor, safe_set: SamplingConfig) -> tuple[Tensor, Tensor, Tensor]:
    """``(logp, inside, mass)`` ``[B, T]`` of ``targets`` on DVP's safe set ``safe_set`` (a sampling recipe without
    penalties) of raw logits ``[B, T, V]``, in the trainer's filter order (HF's: top-k, top-p, min-p): one
    :func:`~offpolicy.forward_scores.token_scores` pass. Differentiable through ``logp``.

    >>> z = torch.tensor([[[3.0, 0.0, -1.0]]])                    # p = (0.9364, 0.0466, 0.0171)
    >>> logp, inside, mass = dvp_scores(z, torch.tensor([[2]]), SamplingConfig(top_p=0.95, min_p=1e-6))
    >>> inside, round(float(mass), 4)                             # top-p keeps the first two: Z = 0.9829
    (tensor([[False]]), 0.9829)
    """
    from offpolicy.forward_scores import token_scores

    vocab = logits.shape[-1]
    s = token_scores(targets.reshape(-1), logits=logits.reshape(-1, vocab), recipe=safe_set, order=TRUNCATION_ORDER)
    assert s.logp is not None and s.mass is not None  # token_scores' defaults
    return s.logp.reshape(targets.shape), s.inside.reshape(targets.shape), s.mass.reshape(targets.shape)


def exact_token_kl(rollout_logits: Tensor, train_logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """KL(μ‖π) per token ``[B, T]`` from two raw logit tensors ``[B, T, V]``, both at ``sampling``'s temperature.

    Why temperature only, not top-k / top-p / min-p: truncating the two logit sets separately cuts them at different
    tokens (a bf16 tie at the k-th logit, a shifted top-p crossing), and a token one keeps and the other drops makes
    the KL +inf. The KL between the two models' full tempered distributions is finite and is what the TRM paper
    (arXiv 2512.23075 §4) measures from logits.
    """
    full = replace(sampling, top_k=None, top_p=None, min_p=None)
    lmu = process_logits(rollout_logits, full)
    lpi = process_logits(train_logits, full)
    pmu = lmu.exp()
    terms = torch.where(pmu > 0, pmu * (lmu - lpi), torch.zeros_like(pmu))
    return terms.sum(-1).clamp(min=0.0)  # KL ≥ 0; float32 rounding can leave −1e-9
