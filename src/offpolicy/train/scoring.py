"""The trainer's log-probs of sampled tokens (π_old's scoring forward and π_θ's in the update), DVP's constrained
variants, and the exact token KL between the engine's and the trainer's logits.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from offpolicy.rollout.sampling import SamplingConfig, process_logits
from offpolicy.rollout.scoring import sequence_logprobs


def score_policy(model: torch.nn.Module, prompt_ids: list[list[int]], completions: list[list[int]],
                 sampling: SamplingConfig, *, dtype: torch.dtype, dvp_rho: float | None = None,
                 return_logits: bool = False) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
    """The trainer's log-probs ``[B, T]`` of the sampled tokens: ``(logp, mask, raw logits | None, extras)``.

    Plain: processed exactly like the engine (temperature, top-k/p, min-p). DVP (``dvp_rho``): min-p constrained
    log π^mp over the trainer's own safe set V_S (:func:`offpolicy.corrections.vocabulary.dvp_fields`), with
    ``extras["dvp_keep"]`` (sampled token inside V_S, else ratio 0) and ``extras["dvp_mass"]`` (retained mass Z).
    """
    if dvp_rho is None:
        out = sequence_logprobs(model, prompt_ids, completions, sampling, dtype=dtype, return_logits=return_logits)
        return out[0], out[1], (out[2] if return_logits else None), {}
    from offpolicy.corrections.vocabulary import dvp_fields
    from offpolicy.rollout.base import pad_ids

    adaptive = sampling.top_p is not None  # algorithm.dvp_coverage: V_S = top-p(1 − ε) ∩ min-p(ρ)
    # the forward only needs the raw logits: the safe set is applied once, below (a top-p sort per position costs
    # as much as the rest of the scoring)
    plain = replace(sampling, top_p=None, min_p=None) if adaptive else replace(sampling, min_p=None)
    _, mask, logits = sequence_logprobs(model, prompt_ids, completions, plain, dtype=dtype, return_logits=True)
    targets = pad_ids(completions, 0, side="right")[0].to(logits.device)[:, : mask.shape[1]]
    if adaptive:
        logp, extras = adaptive_dvp_fields(logits, targets, mask, sampling)
    else:  # the paper's fixed ρ: pruned logits get −50, not −inf
        fields = dvp_fields(logits, targets, mask, rho=dvp_rho, temperature=sampling.temperature)
        fixed_logp, fixed_extras = fields["logp"], fields["extras"]
        assert isinstance(fixed_logp, Tensor) and isinstance(fixed_extras, dict)
        logp, extras = fixed_logp, dict(fixed_extras)
    return logp, mask, (logits if return_logits else None), extras


def adaptive_dvp_fields(logits: Tensor, targets: Tensor, mask: Tensor,
                        sampling: SamplingConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """DVP over the entropy-adaptive safe set V_S = top-p(1 − ε) ∩ min-p(ρ) of the trainer's own raw logits
    ``[B, T, V]`` (``algorithm.dvp_coverage`` = ε; ``sampling`` carries top-p = 1 − ε and min-p = ρ): log π over V_S
    of the ``targets`` ``[B, T]`` (processed like the engine's μ over V'_S), with a finite stand-in (0) where the
    sampled token is outside V_S or masked, and the extras of :func:`~offpolicy.corrections.vocabulary.dvp_fields`:
    ``dvp_keep`` (y ∈ V_S: DVP's ratio is 0 otherwise) and ``dvp_mass`` (retained mass Z ≥ 1 − ε wherever ρ does not
    cut deeper; DVP Prop. 5.5 bounds the bias by R·T·(1 − Z_min)).

    >>> z = torch.tensor([[[3.0, 0.0, -1.0]]])                    # p = (0.9364, 0.0466, 0.0171)
    >>> cfg = SamplingConfig(top_p=0.95, min_p=1e-6)               # top-p keeps the first two: Z = 0.9829
    >>> logp, extras = adaptive_dvp_fields(z, torch.tensor([[2]]), torch.ones(1, 1, dtype=torch.bool), cfg)
    >>> extras["dvp_keep"], round(float(extras["dvp_mass"]), 4), float(logp)
    (tensor([[False]]), 0.9829, 0.0)
    """
    processed = process_logits(logits, sampling)  # log π over V_S, −inf outside it
    logp = processed.gather(-1, targets[..., None])[..., 0]
    keep = mask & torch.isfinite(logp)
    z = logits.detach().float() / sampling.temperature
    kept = torch.isfinite(processed.detach())
    mass = torch.exp(torch.logsumexp(z.masked_fill(~kept, float("-inf")), -1) - torch.logsumexp(z, -1))
    return torch.where(keep, logp, torch.zeros_like(logp)), {"dvp_keep": keep, "dvp_mass": mass}


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
