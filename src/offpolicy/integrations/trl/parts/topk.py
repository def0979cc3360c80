"""Top-k TRM in TRL (TRM, arXiv 2512.23075; score centering, arXiv 2609.20807): vLLM asked for K log-probs, the
sampled token's taken by id, the top-K carried in TRL's batch; the certified bound's advice
(:mod:`offpolicy.topk_advice`).

Settings: ``topk_logprobs``, ``topk_bound``, ``score_centering``. Metrics: ``offpolicy/topk/…``,
``offpolicy/score_centering/drift_tv`` and ``…/head_mass_q``
(:func:`~offpolicy.objectives.score_centering.centering_token_metrics`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch import Tensor

from offpolicy.corrections.base import Correction
from offpolicy.integrations.trl.parts import TRLBase
from offpolicy.integrations.trl.parts.scoring import Scores
from offpolicy.integrations.trl.topk import TOPK_IDS_KEY, TOPK_LOGP_KEY, pad_topk, sampled_token_logprobs
from offpolicy.objectives.score_centering import centering_token_metrics
from offpolicy.ratios import masked_max, masked_mean
from offpolicy.topk_advice import TopKAdvice, doubling_ks, topk_advice


def _check_score_centering(on: Any, topk: int, replay: bool) -> None:
    """Refuse score centering without vLLM's top-K or with the sampling recipe (its centre is Σ q̂ log p of the full
    tempered p, not of the replayed support). With ALP it composes: the centre comes from the same noisy update
    forward as π_{θ,σ}, so the value is ALP's and the gradient ALP's coefficient times the centred score."""
    if not isinstance(on, bool):
        raise ValueError(f"score_centering must be a bool, got {on!r}")
    if not on:
        return
    if not topk:
        raise ValueError("score_centering: needs the sampler's top-K log-probs; set topk_logprobs=K (vLLM)")
    if replay:
        raise ValueError("score_centering: centres the full tempered π_θ; not with sampling_replay / dvp_rho")


def _trm_thresholds(correction: Correction | None) -> tuple[float | None, float | None] | None:
    """TRM's ``(max_kl, avg_kl)`` if ``correction`` is or chains the ``trm`` preset, else None."""
    if correction is None:
        return None
    if correction.name == "trm":
        return correction.config.get("max_kl"), correction.config.get("avg_kl")  # type: ignore[return-value]
    for part in correction.parts:
        found = _trm_thresholds(part)
        if found is not None:
            return found
    return None


class TopKGeneration(TRLBase):
    """vLLM's top-K through TRL's generation, and its metrics (a part of ``OffPolicyGRPOMixin``)."""

    _last_loaded_step: int  # TRL's: the global step whose weights the vLLM engine holds

    def _setup_topk(self, train_args: Any, correction: Correction | None, topk_logprobs: int, topk_bound: str,
                    score_centering: bool) -> None:
        """K, the bound, score centering, and the certified bound's diagnostic (TRM with the upper bound)."""
        self.offpolicy_topk = topk_logprobs
        self.offpolicy_topk_bound = topk_bound
        self.offpolicy_score_centering = score_centering
        # the certified bounds cost more than the centre (a sort of π's tail per row): under score centering they
        # are computed only for a TRM that reads them; the top-K alone asks for them as its diagnostic
        self.offpolicy_topk_bounds = bool(topk_logprobs) and (
            not score_centering or _trm_thresholds(correction) is not None)
        self._offpolicy_pending_topk: tuple | None = None
        # the certified bound's diagnostic (offpolicy.topk_advice): TRM with the upper bound on the top-K
        self.offpolicy_trm = _trm_thresholds(correction) if topk_logprobs and topk_bound == "upper" else None
        self.offpolicy_topk_advice: TopKAdvice | None = None  # the latest batch's
        self._offpolicy_warned_vacuous = False
        self._offpolicy_advice_ks: list[int] | None = None  # the K' tried, until the first update has run
        if self.offpolicy_trm is not None:
            vocab = int(getattr(getattr(getattr(self, "model", None), "config", None), "vocab_size", 0) or 0)
            self._offpolicy_advice_ks = doubling_ks(topk_logprobs, vocab) if vocab > topk_logprobs else []
        if topk_logprobs:
            self._check_topk(train_args)

    def _topk_metrics(self, s: Scores, mask: Tensor, topk_logp: Tensor | None) -> dict[str, Any]:
        """The update forward's top-k numbers: the bounds' means and max (when computed), score centering's drift and
        head mass, the advice."""
        metrics: dict[str, Any] = {}
        if s.kl_lower is not None and s.kl_upper is not None:
            metrics.update({"topk/kl_lower_mean": masked_mean(s.kl_lower, mask),
                            "topk/kl_upper_mean": masked_mean(s.kl_upper, mask),
                            "topk/kl_upper_max": masked_max(s.kl_upper, mask)})
        if s.drift is not None and topk_logp is not None:
            metrics.update({k: masked_mean(v, mask) for k, v in centering_token_metrics(s.drift, topk_logp).items()})
        if self.offpolicy_trm is not None and topk_logp is not None:
            metrics.update(self._topk_advice(s, mask, topk_logp))
        return metrics

    def _check_topk(self, train_args: Any) -> None:
        if not getattr(train_args, "use_vllm", False):
            raise ValueError("topk_logprobs: only vLLM returns top-k log-probs in TRL; set use_vllm=True")
        if getattr(self, "tools", None) or getattr(self, "rollout_func", None) is not None \
                or getattr(self, "environment_factories", None) is not None:
            raise ValueError("topk_logprobs: not carried through tool calls, rollout_func or environments")
        generation = getattr(self, "vllm_generation", None)
        if generation is not None:
            generation.logprobs = self.offpolicy_topk  # vLLM returns K (or K + 1) entries per token

    def _generate_single_turn(self, prompt_ids: Any, images: Any, multimodal_fields: Any, num_generations: int,
                              has_tool_images: bool = False) -> Any:
        if not self.offpolicy_topk:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        # TRL's vLLM branch, keeping the sampled token's log-prob (TRL keeps lp[0], the top-1's, when K > 0)
        if self.state.global_step != self._last_loaded_step:
            self.vllm_generation.sync_weights()
            self._last_loaded_step = self.state.global_step
        _, completion_ids, logprobs, token_ids = self.vllm_generation.generate(
            prompts=prompt_ids, images=images, num_generations=num_generations)
        if logprobs is None or token_ids is None:
            raise ValueError("logprob_token_ids: the vLLM engine returned no log-prob ids; topk_logprobs needs them")
        sampled, top_lp, top_ids = sampled_token_logprobs(logprobs, token_ids, completion_ids, self.offpolicy_topk)
        self._offpolicy_pending_topk = (top_lp, top_ids)
        return completion_ids, sampled

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        self._offpolicy_pending_topk = None
        output = super()._generate_and_score_completions(inputs)
        if self.offpolicy_topk:
            if self._offpolicy_pending_topk is None:
                raise ValueError("topk_logprobs: no top-k log-probs came back from generation")
            top_lp, top_ids = self._offpolicy_pending_topk
            completion = output["completion_ids"]
            output[TOPK_LOGP_KEY], output[TOPK_IDS_KEY] = pad_topk(
                top_lp, top_ids, completion.shape[1], self.offpolicy_topk, completion.device)
            self._offpolicy_pending_topk = None
        return output

    def _topk_advice(self, s: Scores, mask: Tensor, topk_logp: Tensor) -> dict[str, Any]:
        """The certified bound's diagnostic on this batch (:mod:`offpolicy.topk_advice`): its metrics, and one
        warning the first time the bound is vacuous. The suggested K is estimated on the first update."""
        assert s.kl_lower is not None and s.kl_upper is not None and self.offpolicy_trm is not None
        max_kl, avg_kl = self.offpolicy_trm
        ks = self._offpolicy_advice_ks or []
        own = s.own_slack if s.own_slack is not None and ks else None
        advice = topk_advice(s.kl_lower.detach(), s.kl_upper.detach(), mask, topk_logp, max_kl=max_kl,
                             avg_kl=avg_kl, own_slack=own, ks=ks if own is not None else ())
        if own is not None:
            self._offpolicy_advice_ks = None
        elif self.offpolicy_topk_advice is not None:
            first = self.offpolicy_topk_advice
            advice = dataclasses.replace(advice, suggested_k=first.suggested_k,
                                         suggested_k_max_only=first.suggested_k_max_only)
        if advice.vacuous and not self._offpolicy_warned_vacuous:
            warnings.warn(advice.message(), stacklevel=2)
            self._offpolicy_warned_vacuous = True
        self.offpolicy_topk_advice = advice
        return {"topk/head_mass": torch.tensor(advice.head_mass), "topk/slack_mean": torch.tensor(advice.slack),
                "topk/certifiable_frac": torch.tensor(advice.certifiable)}
