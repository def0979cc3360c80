"""Token-level objectives, one file per method, each registered by name (:func:`offpolicy.register_objective`).

An objective is a function ``(inputs: TokenInputs, **params) -> TokenLoss`` that reads like its equation;
:func:`offpolicy.policy_loss` cleans the inputs, applies the correction, aggregates, and differentiates with autograd.

=============  ==========================================================================  =================
name           per-token loss (A advantage, r ratio, sg stop-gradient)                     file
=============  ==========================================================================  =================
``ppo``        −min(r A, clip(r, 1−ε_low, 1+ε_high) A), r = π_θ/π_old, optional dual clip   ``ppo.py``
``decoupled``  (π_old/μ) · PPO term                                                        ``ppo.py``
``bypass``     PPO term on r = π_θ/μ                                                       ``ppo.py``
``gspo``       PPO term on the geometric sequence ratio, per-token gradient               ``ppo.py``
``reinforce``  −A log π_θ                                                                  ``reinforce.py``
``cispo``      −sg[clip(r, 1−ε_low, 1+ε_high)] A log π_θ                                  ``cispo.py``
``sapo``       −(4/τ) σ(τ (r − 1)) A                                                       ``sapo.py``
``dppo_tv``    −A sg[min(r, C)] log π_θ · 1[binary TV inside the trust region]            ``dppo.py``
``dppo_kl``    −A sg[min(r, C)] log π_θ · 1[binary KL inside the trust region]            ``dppo.py``
``ipo``        −A r 1[|π_θ(y) − μ(y)| ≤ δ] + τ_kl (log r)², r = π_θ/μ (prime-rl)          ``ipo.py``
=============  ==========================================================================  =================

``calibrated_clip`` (``calibrated_clip.py``, arXiv 2609.22870) is the PPO term on r = π_θ/μ whose ε_low / ε_high are
widened to the batch's π_old/μ quantiles (floored at the usual ε): low-precision rollout noise is not clipped.

Score centering (arXiv 2609.20807, ``score_centering.py``) is not an objective of its own: it changes the score that
any objective differentiates (:func:`~offpolicy.objectives.score_centering.centered_logp`), from the sampler's
distribution, which a token-level objective does not see; the reference trainer wires it (preset ``score_centering``).
``score_centering_is.py`` gives the centre coefficients that follow a TIS / IcePop / replay rule (NeMo-RL's), with the
sampled token's weight in the same log-prob (presets ``score_centering_tis`` / ``_icepop`` / ``_replay``).
``proximal.py`` is ``decoupled``'s ``proximal="loglinear"``: π_old from the batch's policy versions (AReaL).
"""

# importing the objective modules registers them
from offpolicy.objectives import calibrated_clip, cispo, dppo, ipo, ppo, reinforce, sapo, score_centering  # noqa: F401
from offpolicy.objectives.base import TokenInputs, TokenLoss

__all__ = ["TokenInputs", "TokenLoss"]
