"""Driver-side corrections for verl: once per step, where the advantages exist, written back as verl's helper does.

verl 0.9's v1 trainer calls its own ``compute_rollout_correction_and_add_to_batch`` in ``_compute_advantage`` *before*
the advantages are computed, so a correction that reads them (OPSM, arXiv 2512.02556 §3.1) cannot run there. The
plug-in's trainer, :class:`OffPolicyTrainer` (registered as ``trainer.v1.trainer_mode=offpolicy`` — verl's
``register_trainer`` extension point; it is verl's ``sync`` trainer with one method extended), runs verl's whole
``_compute_advantage`` first and then :func:`apply_driver_correction` on the stored fields: ``response_mask`` becomes
``response_mask · keep`` (a rejected token leaves the loss and its denominators, as verl's rejection does) and
``rollout_is_weights`` becomes the correction's weights, both written back to the TransferQueue as the nested fields
verl's ``_compute_advantage`` writes. verl's own correction (``algorithm.rollout_correction.rollout_is`` /
``rollout_rs``) and the plug-in's cannot both be on: their weights would multiply and their rejections compound, so
the trainer refuses the pair at construction (:func:`refuse_double_correction`), as the TRL trainer refuses TRL's own
importance sampling next to a correction; it also refuses there every setting the actor strategy or rollout backend
cannot honour (the plug-in's engine methods under Megatron, a sampling recipe under SGLang:
:func:`~offpolicy.integrations.verl.hosts.check_verl_host`). The metrics
use verl's names (``rollout_corr/…``). With ``topk_logprobs``, the engine's bound on KL(μ ‖ π_old) per token (computed
in the old-log-prob forward from the rollout's top-K, :mod:`.topk`) is read too and is the divergence ``trm`` tests —
TRM on the engine's top-K (arXiv 2512.23075 §4). With a sampling recipe (DVP's min-p, replay), which sampled tokens
π_old's support holds and its retained mass (the same forward) go to :func:`~offpolicy.dvp_keep` ahead of the
correction: a token outside the support leaves the loss and ``dvp_keep/…``, ``dvp/mass_*`` are logged, as in the
reference trainer and TRL (not in verl's bypass mode, which runs no old-log-prob forward). The actor's loss
(``vanilla`` or the plug-in's) multiplies by ``rollout_is_weights``, as it does for verl's own correction.

Its checkpoints hold the plug-in's settings, and a resume whose settings differ is refused (:mod:`.resume`).
The same trainer runs the sync check after each of verl's weight syncs (``on_init_end`` calibrates, ``on_step_end``
judges; :mod:`.sync_check`), unless the settings say ``sync_check: off``.
"""

from __future__ import annotations

from typing import Any

import torch  # noqa: F401  (the doctest uses it)
from torch import Tensor

from offpolicy.integrations.verl.hosts import BYPASS_KEY, check_verl_host, config_value
from offpolicy.integrations.verl.loss import rollout_correction
from offpolicy.integrations.verl.settings import DVP_KEEP_FIELD, DVP_MASS_FIELD, VerlSettings, settings_from_environment
from offpolicy.integrations.verl.topk import KL_LOWER_FIELD, KL_UPPER_FIELD

REQUIRED_FIELDS = ("old_log_probs", "rollout_log_probs", "response_mask", "advantages")


def apply_driver_correction(batch: dict[str, Tensor], settings: VerlSettings) -> tuple[dict[str, Tensor], dict]:
    """The correction of ``settings`` on verl's padded step tensors [B, T]: ``(updates, metrics)``.

    ``batch`` holds ``old_log_probs``, ``rollout_log_probs``, ``response_mask``, ``advantages`` and optionally
    ``rollout_is_weights`` (weights already on the batch, multiplied in: a user's own loop; the plug-in's trainer
    refuses verl's own correction next to this one, :func:`refuse_double_correction`) and ``token_divergence`` (the engine's top-K bound on
    KL(μ ‖ π_old), what ``trm`` then tests) and ``dvp_keep`` / ``dvp_mass`` (the sampling recipe's support at each
    sampled token and its retained mass, from the engine's old-log-prob forward: :func:`~offpolicy.dvp_keep` then
    runs first, as the reference trainer chains it). ``updates`` = ``{"response_mask": mask · keep (mask's dtype),
    "rollout_is_weights": weights · mask · keep (float32)}``; metrics are 0-d tensors under verl's names.

    >>> from offpolicy.integrations.verl.settings import parse_settings
    >>> b = {"old_log_probs": torch.zeros(1, 2), "rollout_log_probs": torch.tensor([[0.0, -2.0]]),
    ...      "response_mask": torch.ones(1, 2), "advantages": torch.ones(1, 2)}
    >>> up, _ = apply_driver_correction(b, parse_settings({"correction": {"name": "tis", "upper": 2.0}}))
    >>> up["rollout_is_weights"]
    tensor([[1., 2.]])
    """
    missing = [k for k in REQUIRED_FIELDS if k not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}: the driver correction needs {REQUIRED_FIELDS} (set "
                         "actor_rollout_ref.rollout.calculate_log_probs=True for rollout_log_probs)")
    if settings.correction is None:
        raise ValueError("offpolicy.correction is not set: nothing to apply")
    mask = batch["response_mask"]
    divergence = batch.get("token_divergence")
    if settings.topk_logprobs > 0 and divergence is None:
        raise ValueError("offpolicy.topk_logprobs is set but the batch has no token_divergence (the engine's top-K "
                         "bounds): the old-log-prob forward did not run on the top-K (bypass mode?)")
    correction, extras = settings.correction, {}
    if "dvp_keep" in batch:  # the sampling recipe's support: a token outside it leaves the loss, as in the trainer
        specs = correction if isinstance(correction, list) else [correction]
        correction = [{"name": "dvp_keep"}, *specs]
        extras = {"dvp_keep": batch["dvp_keep"].bool(), "dvp_mass": batch["dvp_mass"].float()}
    weights, keep, metrics = rollout_correction(batch["old_log_probs"].float(), batch["rollout_log_probs"].float(),
                                                mask, correction, advantages=batch["advantages"].float(),
                                                naming=settings.naming, token_divergence=divergence,
                                                max_nonfinite_rollout=settings.max_nonfinite_rollout, extras=extras)
    kept = mask.bool() & keep
    weights = weights.float() * kept
    if batch.get("rollout_is_weights") is not None:
        weights = weights * batch["rollout_is_weights"].float()
    return {"response_mask": kept.to(mask.dtype), "rollout_is_weights": weights}, metrics


def refuse_double_correction(algorithm: Any, settings: VerlSettings) -> None:
    """A one-line ``ValueError`` when verl's own correction and the plug-in's are both set.

    ``algorithm`` is verl's ``algorithm`` config (an OmegaConf node or a dict; None → nothing to check). verl's
    correction is on when ``rollout_correction.rollout_is`` (IS weights) or ``rollout_correction.rollout_rs``
    (rejection) is not null — verl then writes ``rollout_is_weights`` / masks ``response_mask`` before the advantages,
    and the plug-in's weights would multiply into them (a double correction).

    >>> from offpolicy.integrations.verl.settings import parse_settings
    >>> tis = parse_settings({"correction": {"name": "tis", "upper": 2.0}})
    >>> refuse_double_correction({"rollout_correction": {"rollout_is": None, "rollout_rs": None}}, tis)
    >>> refuse_double_correction({"rollout_correction": {"rollout_is": "token"}}, tis)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: algorithm.rollout_correction.rollout_is='token' and OFFPOLICY_VERL's correction are both set: ...
    """
    if settings.correction is None or algorithm is None:
        return
    own = algorithm.get("rollout_correction", None)
    if own is None:
        return
    enabled = [f"algorithm.rollout_correction.{key}={own.get(key)!r}" for key in ("rollout_is", "rollout_rs")
               if own.get(key, None) is not None]
    if enabled:
        raise ValueError(f"{' and '.join(enabled)} and OFFPOLICY_VERL's correction are both set: verl's own "
                         "correction and offpolicy's would multiply (a double correction); set rollout_is and "
                         "rollout_rs of algorithm.rollout_correction to null, or remove correction from OFFPOLICY_VERL")


def _metric_floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v.detach()) if isinstance(v, Tensor) else float(v) for k, v in metrics.items()}


class OffPolicyTrainerMixin:
    """verl's trainer + :func:`apply_driver_correction` once the advantages are stored, and the sync check after each
    weight sync: put in front of a verl v1 ``PPOTrainer`` subclass by :func:`make_trainer_class` (it imports nothing
    of verl until a step runs, so this module loads without verl)."""

    config: Any

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        # refuse a double correction, or a setting this actor strategy / rollout backend cannot honour, before verl
        # builds anything (workers, the replay buffer)
        settings = settings_from_environment()
        refuse_double_correction(config.get("algorithm", None), settings)
        check_verl_host(config, settings, sync_check=True)
        super().__init__(config, *args, **kwargs)  # type: ignore[call-arg]  # verl's trainer, after this mixin

    def _settings(self) -> VerlSettings:
        settings = getattr(self, "_offpolicy_settings", None)
        if settings is None:
            settings = settings_from_environment()
            refuse_double_correction(self.config.get("algorithm", None), settings)
            self._offpolicy_settings = settings
        return settings

    def _save_checkpoint(self) -> None:
        from offpolicy.integrations.verl.resume import save_settings

        # before verl's save, which ends by naming the folder in its tracker: a folder it names holds the settings
        save_settings(self.config, int(getattr(self, "global_steps", 0)), self._settings())
        super()._save_checkpoint()  # type: ignore[misc]  # verl's trainer, after this mixin

    def _load_checkpoint(self) -> None:
        from offpolicy.integrations.verl.resume import check_on_resume

        check_on_resume(self.config, self._settings())  # settings unlike the checkpoint's: refused before loading
        super()._load_checkpoint()  # type: ignore[misc]

    def on_init_end(self) -> None:
        super().on_init_end()  # type: ignore[misc]  # verl's initial sync: the sync check calibrates on it
        self._offpolicy_sync_check()

    def on_step_end(self) -> None:
        super().on_step_end()  # type: ignore[misc]  # verl's weight sync after the step's update
        self._offpolicy_sync_check()

    def _offpolicy_sync_check(self) -> None:
        """The sync check after verl's push (:mod:`.sync_check`); its ``sync/*`` metrics join the step's
        through verl's ``_pending_sync_metrics``."""
        settings = self._settings()
        if settings.sync_check == "off":
            return
        check = getattr(self, "_offpolicy_check", None)
        if check is None:
            from offpolicy.integrations.verl.sync_check import from_trainer

            check = self._offpolicy_check = from_trainer(self, settings.sync_check, settings.sync_check_timeout)
        metrics = check.after_sync(int(getattr(self, "global_steps", 0)))
        self._pending_sync_metrics = {**(getattr(self, "_pending_sync_metrics", None) or {}), **metrics}

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        settings = self._settings()  # refuses a double correction before verl's own runs
        batch = super()._compute_advantage(batch, metrics)  # type: ignore[misc]  # verl's trainer, after this mixin
        if settings.correction is None:
            return batch
        from verl.trainer.ppo.v1 import trainer_base
        from verl.workers.utils.padding import response_from_nested, response_to_nested

        tq = trainer_base.tq
        fields = list(REQUIRED_FIELDS)  # verl wrote no weights of its own: refuse_double_correction
        bound = None
        if settings.topk_logprobs > 0:  # the engine's bounds, laid out as its log_probs (prompt + response)
            bound = KL_UPPER_FIELD if settings.topk_bound == "upper" else KL_LOWER_FIELD
            fields.append(bound)
        # the old-log-prob forward wrote them (none runs in bypass mode)
        support = settings.sampling.active and not config_value(self.config, BYPASS_KEY)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=fields + ([DVP_KEEP_FIELD, DVP_MASS_FIELD] if support else []))
        nested_mask = data["response_mask"]
        if bound is not None:
            data["token_divergence"] = response_from_nested(data.pop(bound), nested_mask)
            fields[-1] = "token_divergence"
        if support:  # the recipe's support and its mass, per response token: DVP's dvp_keep in the correction
            data["dvp_keep"] = response_from_nested(data.pop(DVP_KEEP_FIELD), nested_mask)
            data["dvp_mass"] = response_from_nested(data.pop(DVP_MASS_FIELD), nested_mask)
            fields += ["dvp_keep", "dvp_mass"]
        padded = data.to_padded_tensor()
        tensors = {k: padded[k] for k in fields if k in padded.keys()}  # noqa: SIM118 - TensorDict keys
        updates, step_metrics = apply_driver_correction(tensors, settings)
        metrics.update(_metric_floats(step_metrics))
        from tensordict import TensorDict

        output = TensorDict({k: response_to_nested(v, nested_mask) for k, v in updates.items()},
                            batch_size=len(batch))
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=output)


def make_trainer_class(base: type) -> type:
    """``base`` (a verl v1 ``PPOTrainer`` subclass) with :class:`OffPolicyTrainerMixin` in front of it: the driver
    correction after ``_compute_advantage``, the sync check after verl's weight syncs. Named ``OffPolicy<base>``."""
    name = f"OffPolicy{base.__name__}"
    return type(name, (OffPolicyTrainerMixin, base), {"__module__": __name__, "__qualname__": name})


def corrected(data: Any, settings: VerlSettings) -> dict[str, float]:
    """Apply :func:`apply_driver_correction` to a ``DataProto`` in place (legacy trainer / a user's own loop);
    returns the metrics as floats."""
    present = data.batch.keys()
    tensors = {k: data.batch[k] for k in (*REQUIRED_FIELDS, "rollout_is_weights") if k in present}
    updates, metrics = apply_driver_correction(tensors, settings)
    for k, v in updates.items():
        data.batch[k] = v
    return _metric_floats(metrics)


__all__ = ["REQUIRED_FIELDS", "OffPolicyTrainerMixin", "apply_driver_correction", "corrected", "make_trainer_class",
           "refuse_double_correction"]
