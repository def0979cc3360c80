"""TRL integration: offpolicy's corrections, losses and seed methods inside TRL's ``GRPOTrainer``.

Two levels, pick one:

* :func:`trl_policy_loss` — a pure function from TRL's per-step ``inputs`` dict (``completion_mask``, ``advantages``,
  ``old_per_token_logps``, ``sampling_per_token_logps``) and the current per-token log-probs to ``(loss, metrics)``.
  Use it from your own ``GRPOTrainer._compute_loss`` override.
* ``OffPolicyGRPOTrainer`` — a drop-in subclass of ``trl.GRPOTrainer`` (imported on first access, so importing this
  module never imports TRL; ``OffPolicyGRPOMixin`` composes the same way in front of one's own ``GRPOTrainer``
  subclass) that takes ``correction=``, ``objective=``, ``aggregation=``, ``metric_naming=``, the seed methods'
  switches and everything ``GRPOTrainer`` takes; corrections and objectives are registered names (a
  plug-in's too) or objects::

      from offpolicy.integrations.trl import OffPolicyGRPOTrainer
      trainer = OffPolicyGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(..., use_vllm=True,
                                     vllm_importance_sampling_correction=False),
                                     correction=[{"name": "icepop"}, {"name": "opsm", "delta": 0.5}])

The seed methods, each one argument (``docs/frameworks/trl.md`` has the full page):

* ``sampling_replay=True`` — π_old and π_θ are scored under the recipe the engine sampled with (temperature, top-k,
  top-p, min-p, repetition penalty; vLLM's frequency / presence penalties), in that engine's filter order (HF
  ``generate``: temperature → top-k → top-p → min-p; vLLM: penalties → temperature → min-p → top-k / top-p), in
  chunks within ``memory_budget_bytes``; a token outside the trainer's support leaves the loss; ``dvp/mass_mean``,
  ``dvp/mass_min``, ``dvp_keep/masked_frac`` are logged.
* ``dvp_rho=ρ`` — DVP (arXiv 2512.23087): the engine samples with ``min_p = ρ`` and the trainer replays it.
* ``alp=True`` / ``alp={"init_std": 1e-4, "lr": 5e-4, "level": "token", ...}`` — ALP (arXiv 2603.19470): learnable
  noise on the decoder layers' inputs in the update forward only, σ in its own optimiser group, out of the model's
  ``state_dict``, saved in TRL checkpoints (``offpolicy_alp.pt``), its gradient all-reduced across processes.
* ``topk_logprobs=K`` with ``correction="trm"`` (or ``"ln_trm"``) — TRM (arXiv 2512.23075) on vLLM's top-K: the
  sampled token's log-prob taken by id (TRL keeps the top-1's), the top-K carried in TRL's batch, the per-token
  divergence the certified upper bound (``topk_bound="upper"``) or the coarse-grained lower bound.
* ``topk_logprobs=K, score_centering=True`` — score centering (arXiv 2609.20807) on vLLM's top-K with the
  proportional tail: π_θ's log-probs carry the centred score (value unchanged) for every objective and correction.

``OffPolicyAsyncGRPOTrainer`` is the same switch for TRL 1.16's asynchronous ``AsyncGRPOTrainer``
(``trl.experimental.async_grpo``; imported on first access as well): ``correction=``, ``objective=``, … on its
packed loss path, each sample's policy version carried to the loss (staleness metrics, the log-linear π_prox);
:mod:`offpolicy.integrations.trl.async_grpo` has how it plugs in. ``FileWeightTransfer`` is its weight transfer
without NCCL (a reload folder a vLLM server reloads, e.g. vLLM's CPU build).

Without vLLM, :func:`engine_rollout` makes one of offpolicy's own rollout engines (bf16 + KV cache, llama.cpp, a
lagging copy) TRL's ``rollout_func``: its log-probs are μ, a real mismatch on any machine.

TRL's names map as follows: ``sampling_per_token_logps`` (vLLM's log-probs) is μ = ``rollout_logp``;
``old_per_token_logps`` is π_old (TRL leaves it out when there is a single update per generation — then π_old = π_θ
detached, as in TRL); without vLLM there is no separate μ and μ = π_old (every correction is then the identity), so
the methods that exist only to act on μ — ``m2po``, and objectives that read μ (``ipo``, ``bypass``) — are refused.
TRL's own IS correction must be off (``vllm_importance_sampling_correction=False``) when an offpolicy correction is
given, or the mismatch would be corrected twice; the subclass refuses it (TRL's default ``sequence_mask`` at 3.0 is
``mis(level="sequence", upper=3.0)``). A vLLM server whose ``logprobs_mode`` is not ``processed_logprobs`` is refused
(μ would not be the sampling distribution). Every GRPOConfig option TRL 1.16 trains with runs under the subclass,
composed with the correction and logged under TRL's names (``entropy``, ``kl``, ``aux_loss``, ``clip_ratio/…``):
every ``loss_type`` with TRL's own normalisers, ``epsilon`` / ``epsilon_high`` (CISPO's default cap included),
``delta``, ``beta`` with the reference model (``sync_ref_model`` too), the entropy bonus and its adaptive form,
``importance_sampling_level="sequence"``, ``top_entropy_quantile`` and ``off_policy_mask_threshold`` (TRL's own
functions), the MoE router loss and vision inputs (:mod:`offpolicy.integrations.trl.terms`; tested beside vanilla
TRL in ``tests/integrations/test_trl_options.py``). Refused, each in one line naming both settings: a correction
together with TRL's own IS correction, SAPO at sequence level, a ``loss_type`` TRL 1.16 does not have. When TRL
hands over the vLLM log-probs, the mismatch diagnostics are logged too, under TRL's ``sampling/…`` names by default
(``metric_naming``).
"""

from __future__ import annotations

from typing import Any

from offpolicy.integrations.trl.async_sync import FileWeightTransfer
from offpolicy.integrations.trl.loss import (
    TRL_LOSS_TYPES,
    batch_from_trl_inputs,
    trl_objective,
    trl_policy_loss,
)
from offpolicy.integrations.trl.mixin import OffPolicyGRPOMixin
from offpolicy.integrations.trl.patches import extra_llm_kwargs, server_sync_choice
from offpolicy.integrations.trl.replay import ENGINE_ORDERS, trl_sampling_recipe
from offpolicy.integrations.trl.rollout import engine_rollout, sampling_from_trl
from offpolicy.integrations.trl.topk import pad_topk, sampled_token_logprobs
from offpolicy.integrations.trl.vllm_sync import FileSync, install_vllm_sync
from offpolicy.losses import needs_rollout_logp

__all__ = [
    "ENGINE_ORDERS",
    "FileSync",
    "FileWeightTransfer",
    "OffPolicyAsyncGRPOTrainer",
    "OffPolicyGRPOMixin",
    "OffPolicyGRPOTrainer",
    "TRL_LOSS_TYPES",
    "batch_from_trl_inputs",
    "engine_rollout",
    "extra_llm_kwargs",
    "install_vllm_sync",
    "needs_rollout_logp",
    "pad_topk",
    "sampled_token_logprobs",
    "sampling_from_trl",
    "server_sync_choice",
    "trl_objective",
    "trl_policy_loss",
    "trl_sampling_recipe",
]


def __getattr__(name: str) -> Any:
    if name == "OffPolicyGRPOTrainer":  # imported on first access: importing this package never imports TRL
        from offpolicy.integrations.trl.grpo import OffPolicyGRPOTrainer

        return OffPolicyGRPOTrainer
    if name == "OffPolicyAsyncGRPOTrainer":  # TRL 1.16's trl.experimental.async_grpo, imported on first access too
        from offpolicy.integrations.trl.async_grpo import OffPolicyAsyncGRPOTrainer

        return OffPolicyAsyncGRPOTrainer
    raise AttributeError(name)
