"""ALP (arXiv 2603.19470) in TRL: the perturbation built on the model's decoder layers, σ's optimiser group, σ saved in
and restored from TRL's checkpoints (:mod:`offpolicy.integrations.trl.alp`).

Settings: ``alp`` (True or a dict with keys from :data:`ALP_KEYS`). Metrics: ``offpolicy/alp/…`` (the perturbation's).
"""

from __future__ import annotations

import os
from typing import Any

from offpolicy.integrations.trl.alp import alp_callback
from offpolicy.integrations.trl.parts import TRLBase
from offpolicy.integrations.trl.parts.sharding import model_sharding
from offpolicy.perturbation import (
    DEFAULT_INIT_STD,
    DEFAULT_LR,
    LayerwisePerturbation,
    alp_clip_defaults,
    load_alp,
    save_alp,
)

ALP_KEYS = ("init_std", "lr", "layers", "layers_path", "seed", "level")


def _check_alp(alp: Any) -> dict[str, Any] | None:
    if alp is None or alp is False:
        return None
    if alp is True:
        return {}
    if not isinstance(alp, dict):
        raise ValueError(f"alp must be None, True or a dict with keys from {ALP_KEYS}, got {alp!r}")
    unknown = sorted(set(alp) - set(ALP_KEYS))
    if unknown:
        raise ValueError(f"alp has unknown keys {unknown}; choose from {ALP_KEYS}")
    return dict(alp)


class ALPWiring(TRLBase):
    """ALP's σ around TRL's optimiser and checkpoints (a part of ``OffPolicyGRPOMixin``)."""

    def _setup_alp(self, cfg: dict[str, Any] | None, aggregation: str, explicit: dict[str, Any]) -> None:
        """The perturbation (None: ALP off) and its loss level; built on the model TRL has prepared."""
        self.offpolicy_alp: LayerwisePerturbation | None = None
        self.offpolicy_alp_level = "token"
        if cfg is not None:
            self._build_alp(cfg, aggregation, explicit)

    def _build_alp(self, cfg: dict[str, Any], aggregation: str, explicit: dict[str, Any]) -> None:
        if aggregation == "seq_mean_token_sum_norm":
            raise ValueError("alp: loss_type dr_grpo's / luspo's constant normaliser is not reproduced with "
                             "ALP's loss; use another loss_type or aggregation")
        if cfg.get("layers", "all") == "logits":  # TRL's fused head never calls the lm_head module
            raise ValueError("alp: layers='logits' hooks the lm_head module, which TRL's fused head bypasses; "
                             "use 'all' or layer indices")
        level = cfg.get("level", "token")
        low, high = alp_clip_defaults(level)  # validates level
        model = self.model
        accelerator = getattr(self, "accelerator", None)
        if model_sharding(model, accelerator) == "zero3":  # DeepSpeed partitions every parameter of the optimiser
            raise ValueError("alp=: σ is a parameter outside the model, in the optimiser, which ZeRO-3 cannot "
                             "partition; not supported under ZeRO-3 yet (use FSDP2 or DDP)")
        alp = LayerwisePerturbation(model, layers=cfg.get("layers", "all"),
                                    init_std=cfg.get("init_std", DEFAULT_INIT_STD),
                                    layers_path=cfg.get("layers_path"), seed=cfg.get("seed"))
        # the device the model computes on (accelerate's): an offloaded or sharded model's first parameter may sit
        # on the CPU while its forward runs on the accelerator
        device = accelerator.device if accelerator is not None else next(model.parameters()).device
        self.offpolicy_alp = alp.to(device)
        self.offpolicy_alp_level = level
        self.offpolicy_alp_lr = float(cfg.get("lr", DEFAULT_LR))
        delta = getattr(self.args, "delta", None)
        self.offpolicy_alp_clip = {
            "clip_low": low if explicit["clip_low"] is None else explicit["clip_low"],
            "clip_high": high if explicit["clip_high"] is None else explicit["clip_high"],
            "dual_clip": explicit["dual_clip"] if explicit["dual_clip"] is not None
            else (delta if delta is not None else 10.0),
        }
        if hasattr(self, "add_callback"):
            self.add_callback(alp_callback(self.offpolicy_alp, lambda: self.model_wrapped))

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's optimiser plus σ's own group (lr ``alp["lr"]``, no weight decay) when ALP is on."""
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.offpolicy_alp is not None and not any(g.get("name") == "alp" for g in optimizer.param_groups):
            optimizer.add_param_group(self.offpolicy_alp.param_group(lr=self.offpolicy_alp_lr))
        return optimizer

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.offpolicy_alp is not None and self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            save_alp(self.offpolicy_alp, folder)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.offpolicy_alp is not None and checkpoint is not None:
            load_alp(self.offpolicy_alp, checkpoint, setting="resume_from_checkpoint")
