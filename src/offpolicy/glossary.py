"""What every logged metric means — the source of docs/metrics.md.

Three kinds of keys, looked up by :func:`lookup`:

* the mismatch diagnostics of :func:`offpolicy.offpolicy_metrics` (:data:`offpolicy.metrics.METRIC_NAMES`), under
  each framework's names (:data:`offpolicy.metrics.NAMINGS`: the trainer's default ``rollout_correction/…`` is
  ms-swift's, verl's ``rollout_corr/…``, TRL's ``sampling/…``, OpenRLHF's ``train/…``, Tinker's ``optim/…``);
* everything else the trainer, the TRL trainer (the same keys under ``offpolicy/``), the verl plug-in and
  ``offpolicy inspect`` (``report.json``) write: :data:`ENTRIES`, whose keys may hold placeholders (``<is>`` an
  importance-sampling correction's name, ``<layer>``, ``<bin>`` …);
* nothing else: tests/test_glossary.py runs the trainer (every preset, the controllers), the corrections, the
  objectives and the adapters, and fails on a key :func:`lookup` does not know.

What the project measured for a metric is not shipped here: docs/_ext/generated.py reads it from the JSON under
docs/data/ (docs/data/glossary/measured.json, docs/data/sync_check/*.json) into the glossary's "measured here" column.

>>> lookup("offpolicy/tis/capped_frac").key, lookup("sampling/k3_kl").key
('<correction>/capped_frac', 'k3_kl')
>>> lookup("no/such/metric") is None
True
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from offpolicy.metrics import METRIC_NAMES, NAMINGS

TRL_PREFIX = "offpolicy/"  # the TRL trainer logs the trainer's keys under this prefix
VERL_ACTOR_PREFIX = "actor/"  # verl's prefix of its actor's step metrics, the engine's (ALP, score centering) among them


@dataclass(frozen=True)
class Entry:
    """One metric: its ``key`` (a pattern with ``<placeholders>``), what it ``means``, and who logs it."""

    key: str
    means: str
    logged_by: str = "trainer, TRL"


# The diagnostics: name → meaning. Names per framework come from offpolicy.metrics.NAMINGS.
DIAGNOSTICS: dict[str, str] = {
    "kl": "E[log μ − log π] over valid tokens: the direct KL(μ‖π) estimate under μ's samples (can be < 0)",
    "k3_kl": "E[ρ − log ρ − 1], ρ = π_old/μ: Schulman's k3 estimate of KL(μ‖π) per token, ≥ 0",
    "k2_kl": "E[½ (log ρ)²]: the k2 estimate (OpenRLHF, Tinker)",
    "training_ppl": "mean over sequences of the trainer's per-sequence perplexity",
    "training_log_ppl": "mean over sequences of −mean_t log π",
    "rollout_ppl": "mean over sequences of the engine's per-sequence perplexity",
    "rollout_log_ppl": "mean over sequences of −mean_t log μ",
    "log_ppl_diff": "mean over sequences of log PPL_π − log PPL_μ (> 0: the trainer finds the text less likely)",
    "log_ppl_abs_diff": "mean over sequences of |log PPL_π − log PPL_μ|",
    "log_ppl_diff_max": "largest per-sequence log PPL gap",
    "log_ppl_diff_min": "smallest per-sequence log PPL gap",
    "ppl_ratio": "mean over sequences of PPL_π / PPL_μ",
    "chi2_token": "E[ρ_t²] − 1: the token-level χ² divergence (the variance of the IS weights)",
    "chi2_seq": "E[ρ_geo²] − 1 with the geometric (length-normalised) sequence ratio (ms-swift)",
    "chi2_seq_product": "E[ρ_seq²] − 1 with the product sequence ratio (verl's chi2_seq)",
    "ess": "(E w)² / E[w²] ∈ [0, 1]: normalised effective sample size of the weights",
    "is_weight_mean": "mean of the weights applied (the raw ratio when no correction weights)",
    "is_weight_max": "largest weight applied",
    "is_weight_min": "smallest weight applied",
    "clipped_frac": "share of valid tokens whose weight differs from the raw ratio (truncated or masked)",
    "raw_ratio_mean": "mean of the token ratio ρ = π_old/μ before any correction",
    "raw_ratio_max": "largest token ratio ρ = π_old/μ",
    "raw_ratio_min": "smallest token ratio ρ = π_old/μ",
    "logp_abs_diff_mean": "mean |log π − log μ| over valid tokens (TRL's sampling_logp_difference/mean)",
    "logp_abs_diff_max": "largest |log π − log μ|",
    "masked_frac": "share of valid tokens whose weight is 0 (dropped by the correction)",
    "accepted_frac": "1 − masked_frac",
    "nonfinite_tokens": "response positions where log π or log μ is NaN / ±inf (left out of every statistic)",
    "nonfinite_rollout_tokens": "response positions where log μ is NaN / ±inf: the rollout engine's failures (past "
                                "max_nonfinite_rollout, 1e-3 of the valid tokens, the batch is refused)",
}

ENTRIES: tuple[Entry, ...] = (
    # -- the run ---------------------------------------------------------------------------------------------------
    Entry("step", "the optimiser step a row of metrics.jsonl belongs to", "trainer"),
    Entry("reward/mean", "mean reward of the step's rollouts (the engine's samples: with a lagging engine, the old "
          "policy's reward)",
          "trainer"),
    Entry("reward/std", "standard deviation of the step's rewards", "trainer"),
    Entry("reward/max", "largest reward of the step", "trainer"),
    Entry("response/length_mean", "mean response length in tokens", "trainer"),
    Entry("optim/lr", "the learning rate of the step (schedule × the LR guard's cut)", "trainer"),
    Entry("time/rollout_s", "seconds the step spent sampling", "trainer"),
    Entry("time/step_s", "seconds of the whole step", "trainer"),
    Entry("time/tokens_per_s", "sampled tokens per second of the step", "trainer"),
    # -- the weight-sync check (offpolicy.rollout.sync_check; rollout.engine vllm / server) ----------------------------
    Entry("sync/gap", "mean |log p_engine − log p_trainer| on the probe after this step's weight sync", "trainer"),
    Entry("sync/baseline", "the same gap with the same weights on both sides (the run's first sync)", "trainer"),
    Entry("sync/ratio", "sync/gap ÷ sync/baseline", "trainer"),
    Entry("sync/stale_fraction", "β: how far back towards the previous sync's weights the engine is (0 took the new "
          "weights, 1 kept the old)", "trainer"),
    Entry("sync/step_rms", "how much the update moved the probe's log-probs (root mean square), β's resolution",
          "trainer"),
    Entry("sync/ok", "1 when the sync passed every test, 0 when it failed (with rollout.sync_check=warn)",
          "trainer"),
    Entry("sync/params_left", "engine tensors that did not change while their trainer sources did (the parameter "
          "layer, in-process vLLM only; 0 on a healthy sync)", "trainer"),
    Entry("sync/params_checked", "engine tensors the parameter layer can read and map to the trainer's (vLLM's CPU "
          "build repacks its linear weights out of reach)", "trainer"),
    Entry("sync/seconds", "seconds the check took (two forwards of the probe)", "trainer"),
    Entry("sync/threshold", "the gap above which the sync fails: baseline + max(z × √2 × se, floor), within "
          "max_drift × the first baseline", "trainer"),
    Entry("sync/engine_motion", "how far the engine's log-probs moved on the probe since the last verified sync, over "
          "how far the trainer's did (logged, not judged)", "trainer"),
    Entry("sync/verified", "1 when the sync passed and resolved the staleness β (it becomes the reference the next "
          "syncs are measured from)", "trainer"),
    Entry("sync/push_seconds", "seconds the weight push took (TRL's sync, not the check)", "trainer"),
    # -- the loss --------------------------------------------------------------------------------------------------
    Entry("loss/loss", "the policy loss of the step", "trainer"),
    Entry("loss/grad_norm", "gradient norm before clipping (clipped at optim.max_grad_norm)", "trainer"),
    Entry("loss/ratio_mean", "mean of the objective's ratio (π_θ/π_old for PPO; π_θ/μ for bypass)"),
    Entry("loss/ratio_max", "largest objective ratio"),
    Entry("loss/ratio_min", "smallest objective ratio"),
    Entry("loss/clipfrac_low", "share of tokens where PPO's lower clip bound is active"),
    Entry("loss/clipfrac_high", "share of tokens where PPO's upper clip bound is active"),
    Entry("loss/dual_clip_frac", "share of tokens where the dual clip (negative advantages) is active"),
    Entry("loss/empty_batch", "1 when no token counted in the loss (all masked or empty), else 0"),
    Entry("loss/nonfinite_tokens", "valid tokens dropped for a NaN / inf log-prob the objective reads"),
    Entry("loss/ipo_masked", "share of tokens IPO masks, |π_θ(y) − μ(y)| > δ"),
    Entry("loss/calibrated_widened_low", "calibrated_clip: 1 when the batch's π_old/μ quantile widened ε_low past "
          "its floor (per minibatch; the step's mean is the share of minibatches widened)"),
    Entry("loss/calibrated_widened_high", "calibrated_clip: the same for ε_high"),
    # -- what every correction drops or caps (offpolicy.corrections.base.drop_metrics) --------------------------------
    Entry("<correction>/kept_frac", "share of valid tokens the correction leaves as they were: neither masked nor "
          "capped (kept + masked + capped = 1; a reweighted token, as the delight gate's, counts as kept)"),
    Entry("<correction>/masked_frac", "share of valid tokens the correction drops from the loss (weight · keep = 0); "
          "a dropped sequence counts each of its tokens"),
    Entry("<correction>/capped_frac", "share of valid tokens still in the loss whose weight was truncated to a bound "
          "(TIS, calibrated IS, gated_is in truncate mode; 0 for a mask)"),
    Entry("<correction>/masked_seq_frac", "share of sequences (with ≥ 1 valid token) whose every token the correction "
          "drops (TRM's acceptance rate is 1 − it)"),
    # -- each correction's own -------------------------------------------------------------------------------------
    Entry("<is>/raw_ratio_mean", "mean ratio π_old/μ (or π_θ/μ with source=total) before the correction"),
    Entry("<is>/raw_ratio_max", "largest ratio before the correction"),
    Entry("<is>/raw_ratio_min", "smallest ratio before the correction"),
    Entry("<is>/weight_mean", "mean weight after the correction"),
    Entry("<is>/nonfinite_frac", "share of valid tokens with a non-finite ratio (dropped)"),
    Entry("calibrated_is/cap_mean", "mean per-token cap 1 + λ·max(1 − π_old(y), κ) of calibrated IS"),
    Entry("delight/weight_mean", "mean delight gate σ(A·(−log π)/η) over valid tokens (0 where dropped)"),
    Entry("delight/suppressed_frac", "share of valid tokens with negative delight (gate < ½: surprising failures)"),
    Entry("delight/delight_mean", "mean delight A·(−log π(y)) over valid tokens"),
    Entry("delight/surprisal_mean", "mean surprisal −log π(y) over valid tokens"),
    Entry("delight/nonfinite_frac", "share of valid tokens with a non-finite surprisal or advantage (dropped)"),
    Entry("gated_is/stat_mean", "mean of the gated statistic (ratio, binary KL or TV)"),
    Entry("gated_is/stat_max", "largest gated statistic"),
    Entry("opsm/stat_mean", "mean over sequences of mean_t log(μ/π_θ)"),
    Entry("opsm/mismatch_term_mean", "the part of OPSM's statistic from μ vs π_old (the engines' mismatch)"),
    Entry("opsm/staleness_term_mean", "the part from π_old vs π_θ (the policy's movement within the step)"),
    Entry("trm/max_divergence_mean", "mean over sequences of max_t KL_t"),
    Entry("trm/avg_divergence_mean", "mean over sequences of mean_t KL_t"),
    Entry("trm/divergence_exact", "1 when TRM tested the exact per-token KL from the logits"),
    Entry("trm/divergence_topk", "1 when TRM tested the engine's top-K bound"),
    Entry("trm/divergence_k_estimator", "1 when TRM fell back to the k-estimators of the sampled token"),
    Entry("ln_trm/stat_mean", "mean of LN-TRM's length-neutral statistic"),
    Entry("ser/stat_mean", "mean of SER's statistic"),
    Entry("<kl_mode>/stat_mean", "mean of the k2 / k3 statistic of that mode"),
    Entry("m2po/candidate_frac", "share of tokens in PPO's active quadrants (the candidates M2PO may drop)"),
    Entry("m2po/m2_before", "second moment of log(π_θ/μ) over the candidates before masking"),
    Entry("m2po/m2_after", "second moment after masking (≤ τ)"),
    # -- vocabulary, ALP, score centering, top-K --------------------------------------------------------------------
    Entry("dvp/mass_mean", "mean probability mass of the trainer's min-p safe set"),
    Entry("dvp/mass_min", "smallest safe-set mass (DVP's bias bound uses it)"),
    Entry("alp/sigma_mean", "mean learnable noise scale σ over the perturbed layers", "trainer, TRL, verl"),
    Entry("alp/sigma_min", "smallest σ", "trainer, TRL, verl"),
    Entry("alp/sigma_max", "largest σ", "trainer, TRL, verl"),
    Entry("alp/sigma/<layer>", "σ of one perturbed layer", "trainer, TRL, verl"),
    Entry("score_centering/drift_tv", "½‖q − π_θ‖₁ per token: how far the sampler's distribution is from the policy "
          "(from the engine's top-K: the proportional-tail estimate ½‖q̂ − π_θ‖₁, never above the exact one)",
          "trainer, TRL, verl"),
    Entry("score_centering/topk_gap_tv", "½‖q − q̂‖₁: the error of the top-20 proportional-tail centring (needs the "
          "sampler's full logits: the reference trainer's re-score)", "trainer"),
    Entry("score_centering/head_mass_q", "how much of q the top-K holds (the rest is spread ∝ π)",
          "trainer, TRL, verl"),
    Entry("score_centering/is_weight", "mean IS weight of the sampled token in the IS-rule centring (TIS / IcePop)",
          "trainer"),
    Entry("score_centering/is_clipped", "share of tokens whose IS weight the rule clipped or masked", "trainer"),
    Entry("topk/kl_lower_mean", "mean coarse-grained lower bound on KL(μ‖π_θ) from vLLM's top-K", "TRL"),
    Entry("topk/kl_upper_mean", "mean certified upper bound on KL(μ‖π_θ) from vLLM's top-K", "TRL"),
    Entry("topk/kl_upper_max", "largest certified upper bound", "TRL"),
    # -- asynchronous rollouts (TRL's AsyncGRPOTrainer; the trainer's rollout.sync_every / rollout.async_mode) -------
    Entry("staleness/mean", "mean staleness of the step's tokens: the trainer's policy version − the version that "
          "sampled them (TRL's async trainer counts weight syncs, the reference trainer its steps)", "trainer, TRL"),
    Entry("staleness/max", "largest staleness among the step's tokens", "trainer, TRL"),
    Entry("staleness/dropped", "groups the queue dropped this step for being more than rollout.max_staleness "
          "versions old (rollout.async_mode=queue)", "trainer"),
    Entry("staleness/versions_per_answer", "mean over answers of max − min + 1 of their tokens' versions (1: one "
          "version per answer; > 1: the weights switched mid-answer, rollout.async_mode=partial)", "trainer"),
    Entry("staleness/d<d>/k3_kl", "k3 mismatch of π_θ (the reference trainer: π_old) against μ over the tokens of "
          "staleness d", "trainer, TRL"),
    Entry("staleness/d<d>/clipped_frac", "share of the staleness-d tokens whose correction weight was truncated or "
          "masked (0 without a correction)", "trainer, TRL"),
    Entry("staleness/d<d>/masked_frac", "share of the staleness-d tokens the correction dropped (weight 0)",
          "trainer, TRL"),
    Entry("staleness/d<d>/tokens", "number of tokens of staleness d in the micro-batch (the reference trainer: "
          "the step)", "trainer, TRL"),
    # -- control -----------------------------------------------------------------------------------------------------
    Entry("control/trm_max_kl", "TRM-Max δ the controller chose for the step",
          "trainer"),
    Entry("control/trm_avg_kl", "TRM-Avg δ the controller chose", "trainer"),
    Entry("control/is_upper", "the IS band's upper bound the controller chose", "trainer"),
    Entry("control/lr", "the LR guard's learning rate", "trainer"),
    # -- the mismatch by position and from the logits ----------------------------------------------------------------
    Entry("mismatch/token_kl_exact_mean", "mean exact KL(μ‖π_old) per token from both engines' logits (when both "
          "exist)", "trainer"),
    Entry("mismatch/by_position/<stat>/<bin>", "the mismatch statistic (kl, k2_kl, k3_kl, kl_exact, "
          "logp_abs_diff_mean, tokens) over the response positions of one doubling bin", "trainer"),
    # -- mixture of experts: routing flips ---------------------------------------------------------------------------
    Entry("routing/flip_rate", "MoE: share of the (position, layer) slots the engine routed whose top-k expert set "
          "π_old's router picks differently (not logged where the engine records no routes)", "trainer"),
    Entry("routing/flip_rate/layer<n>", "the same share in MoE layer n alone (router order, from 0)", "trainer"),
    # -- verl's own names for the plug-in's loss ---------------------------------------------------------------------
    Entry("actor/grad_norm", "gradient norm before clipping (verl's name)", "verl"),
    Entry("actor/pg_clipfrac", "share of tokens where PPO's clip is active (verl's name)", "verl"),
    Entry("actor/pg_clipfrac_lower", "share of tokens where the dual clip is active (verl's name)", "verl"),
    Entry("actor/ppo_kl", "mean log(π_old/π_θ) over the tokens (verl's name)", "verl"),
    # -- offpolicy inspect: report.json --------------------------------------------------------------------------------
    Entry("inspect:kl_mean", "mean exact KL(μ‖π) over response positions (full distributions)", "inspect"),
    Entry("inspect:kl_median", "median per-position KL", "inspect"),
    Entry("inspect:kl_p99", "99th percentile of the per-position KL", "inspect"),
    Entry("inspect:kl_max", "largest per-position KL", "inspect"),
    Entry("inspect:kl_upper_mean", "mean certified upper bound on the KL (top-K engines)", "inspect"),
    Entry("inspect:kl_reverse_mean", "mean KL(π‖μ)", "inspect"),
    Entry("inspect:kl_nonfinite_positions", "positions whose KL is not finite", "inspect"),
    Entry("inspect:tv_mean", "mean total variation ½‖μ − π‖₁ per position", "inspect"),
    Entry("inspect:tv_max", "largest per-position total variation", "inspect"),
    Entry("inspect:topk_overlap_mean", "mean overlap of the two engines' top-k sets", "inspect"),
    Entry("inspect:sampled_abs_delta_mean", "mean |log π − log μ| of the sampled tokens", "inspect"),
    Entry("inspect:sampled_abs_delta_max", "largest |log π − log μ| of a sampled token", "inspect"),
    Entry("inspect:sampled_nonfinite", "sampled tokens with a non-finite log-ratio", "inspect"),
    Entry("inspect:tail_head_ratio", "error of the vocabulary tail (p < 1e-3) over the head's (p > 0.5)", "inspect"),
    Entry("inspect:tail_abs_delta_mean", "mean |Δ log p| in the tail", "inspect"),
    Entry("inspect:head_abs_delta_mean", "mean |Δ log p| in the head", "inspect"),
    Entry("inspect:pearson_r", "correlation of the two engines' sampled-token probabilities", "inspect"),
    Entry("inspect:ess", "normalised effective sample size of the token ratios", "inspect"),
    Entry("inspect:chi2_token", "token-level χ²", "inspect"),
    Entry("inspect:chi2_seq", "geometric sequence-level χ²", "inspect"),
    Entry("inspect:k3_kl", "k3 estimate of KL(μ‖π) from the sampled tokens", "inspect"),
)

# Names that corrections logged before every correction answered with drop_metrics, and what says it now: docs/metrics.md
# prints this table ("old name → new name"); tests/test_glossary.py checks that no correction logs an old name and that
# every new one is known.
RENAMED: tuple[tuple[str, str], ...] = (
    ("<is>/clipped_frac", "<is>/masked_frac + <is>/capped_frac"),
    ("<is>/kept_frac (a capped token counted as kept)", "<is>/kept_frac + <is>/capped_frac"),
    ("gated_is/filter_frac (OpenRLHF's is_filter_ratio)", "gated_is/masked_frac (+ gated_is/capped_frac in truncate "
     "mode); gated_is/masked_seq_frac at the sequence levels"),
    ("veto/vetoed_seq_frac", "veto/masked_seq_frac"),
    ("trm/accept_rate", "1 − trm/masked_seq_frac"),
    ("ln_trm/accept_rate", "1 − ln_trm/masked_seq_frac"),
    ("ser/accept_rate", "1 − ser/masked_seq_frac"),
    ("<kl_mode>/rejected_frac", "<kl_mode>/masked_frac (token modes); <kl_mode>/masked_seq_frac (sequence modes)"),
    ("chain/kept_token_frac", "1 − chain/masked_frac"),
    ("dvp/outside_frac", "dvp_keep/masked_frac"),
)

IS_NAMES = ("tis", "mis", "geo_mask", "icepop", "importance", "gated_is", "calibrated_is")
KL_MODES = ("token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3", "seq_max_k2",
            "seq_max_k3")
_PLACEHOLDERS = {
    "<correction>": "[^/]+",  # any correction's name: registered, chain, the trainer's correction, or a name= given
    "<is>": "(?:" + "|".join(IS_NAMES) + ")",
    "<kl_mode>": "(?:" + "|".join(KL_MODES) + ")",
    "<layer>": "[^/]+",
    "<stat>": "[^/]+",
    "<bin>": r"pos\d+-\d+",
    "<d>": r"\d+",
    "<n>": r"\d+",
}


def _pattern(key: str) -> re.Pattern[str]:
    text = re.escape(key)
    for placeholder, regex in _PLACEHOLDERS.items():
        text = text.replace(re.escape(placeholder), regex)
    return re.compile(f"^{text}$")


@lru_cache(maxsize=1)
def _compiled() -> tuple[tuple[re.Pattern[str], Entry], ...]:
    return tuple((_pattern(e.key), e) for e in ENTRIES)


def diagnostic_names(name: str) -> dict[str, str]:
    """``{naming: key}`` of one diagnostic under every framework's naming.

    >>> diagnostic_names("ess")["verl"], diagnostic_names("ess")["trl"]
    ('rollout_corr/rollout_is_eff_sample_size', 'sampling/ess')
    """
    return {naming: n.key(name) for naming, n in NAMINGS.items()}


@lru_cache(maxsize=1)
def _diagnostic_keys() -> dict[str, str]:
    return {key: name for name in METRIC_NAMES for key in diagnostic_names(name).values()}


def lookup(key: str) -> Entry | None:
    """The entry that explains a logged ``key`` (any framework's naming, TRL's ``offpolicy/`` prefix, a
    ``report.json`` key as ``inspect:<key>``), or None."""
    diagnostic = _diagnostic_keys().get(key)
    if diagnostic is not None:
        return Entry(diagnostic, DIAGNOSTICS[diagnostic], "trainer, TRL, verl")
    for candidate in (key, key[len(TRL_PREFIX):] if key.startswith(TRL_PREFIX) else None,
                      _verl_driver_key(key), key[len(VERL_ACTOR_PREFIX):] if key.startswith(VERL_ACTOR_PREFIX) else None):
        if candidate is None:
            continue
        for pattern, entry in _compiled():
            if pattern.match(candidate):
                return entry
    return None


def _verl_driver_key(key: str) -> str | None:
    """verl's driver logs a correction's own metrics under its ``rollout_corr/`` prefix."""
    prefix = NAMINGS["verl"].prefix
    return key[len(prefix):] if key.startswith(prefix) else None
