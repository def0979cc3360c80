"""TRL's resume and offpolicy's method settings: saved in each ``checkpoint-N`` folder, compared on resume.

TRL's ``train(resume_from_checkpoint=...)`` (the HF Trainer's: ``True`` → the latest ``output_dir/checkpoint-N``)
restores weights, optimiser and trainer state but knows nothing of the correction, objective or transforms the
trainer was built with, so a run resumed with another threshold would continue silently. This part writes
:data:`~offpolicy.resume_settings.SETTINGS_FILE` into the checkpoint folder in ``_save_checkpoint`` (after TRL's
own save, on the process that saves) and, in ``train``, compares the folder's settings with the trainer's before
TRL loads anything: a difference is refused naming each key with both values, unless the trainer's
``allow_changed=[...]`` names it; then the change is appended to ``output_dir/offpolicy_settings_changes.jsonl``.

Keys (:func:`trl_recipe`): the correction's effective parameters (``correction.upper``), the objective and its
parameters (``objective.name``, ``objective.clip_low`` …), ``aggregation``, ``sampling_replay``, ``dvp_rho``,
``alp.*``, ``topk_logprobs``, ``topk_bound``, ``score_centering`` — not the metric naming, the sync check or vLLM's
arguments.
"""

from __future__ import annotations

import os
from typing import Any

from offpolicy.integrations.trl.parts import TRLBase
from offpolicy.perturbation import DEFAULT_INIT_STD, DEFAULT_LR
from offpolicy.resume_settings import (
    CHANGES_FILE,
    SETTINGS_FILE,
    check_resume,
    correction_settings,
    flatten,
    read_settings,
    record_changes,
    write_json_atomic,
)

ALP_DEFAULTS = {"init_std": DEFAULT_INIT_STD, "lr": DEFAULT_LR, "layers": "all", "layers_path": None, "seed": None,
                "level": "token"}


def trl_recipe(correction: Any, loss: dict[str, Any], *, replay: bool, dvp_rho: float | None,
               alp: dict[str, Any] | None, topk_logprobs: int, topk_bound: str,
               score_centering: bool) -> dict[str, Any]:
    """The trainer's method settings, flat (see the module docstring); ``loss`` is ``offpolicy_loss_kwargs``.

    >>> trl_recipe(None, {"objective": {"name": "ppo_clip", "clip_low": 0.2}, "aggregation": "token_mean"},
    ...            replay=False, dvp_rho=None, alp=None, topk_logprobs=0, topk_bound="upper",
    ...            score_centering=False)["objective.clip_low"]
    0.2
    """
    return {**correction_settings(correction), **flatten({
        "objective": loss["objective"], "aggregation": loss["aggregation"], "max_tokens": loss.get("max_tokens"),
        "sampling_replay": bool(replay), "dvp_rho": dvp_rho,
        "alp": None if alp is None else {**ALP_DEFAULTS, **alp},
        "topk_logprobs": topk_logprobs, "topk_bound": topk_bound, "score_centering": score_centering,
    })}


def _check_allowed(allow_changed: Any) -> tuple[str, ...]:
    if allow_changed is None:
        return ()
    if isinstance(allow_changed, str) or not all(isinstance(a, str) and a for a in allow_changed):
        raise ValueError(f"allow_changed must be a list of setting names (e.g. ['correction.upper']), got "
                         f"{allow_changed!r}")
    return tuple(allow_changed)


class ResumeCheck(TRLBase):
    """The method settings saved with TRL's checkpoints and compared on resume (a part of ``OffPolicyGRPOMixin``)."""

    def _setup_resume_check(self, allow_changed: Any, recipe: dict[str, Any]) -> None:
        self.offpolicy_allow_changed = _check_allowed(allow_changed)
        self.offpolicy_resume_settings = recipe

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            step = int(self.state.global_step)
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{step}")
            write_json_atomic(os.path.join(folder, SETTINGS_FILE),
                              {"step": step, "settings": self.offpolicy_resume_settings})

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        folder = resume_from_checkpoint
        if isinstance(folder, bool):
            from transformers.trainer_utils import get_last_checkpoint

            # None → TRL's own "no valid checkpoint" error, raised by super().train below
            folder = get_last_checkpoint(self.args.output_dir) if folder else None
        if folder is not None:
            self._offpolicy_compare(str(folder))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _offpolicy_compare(self, folder: str) -> None:
        stored = read_settings(os.path.join(folder, SETTINGS_FILE))
        if stored is None:  # TRL alone, or an older offpolicy: nothing to compare with
            import warnings

            warnings.warn(f"resume_from_checkpoint {folder!r} holds no {SETTINGS_FILE} (saved without offpolicy's "
                          "settings): resuming without comparing them", stacklevel=3)
            return
        step = stored.get("step")

        def hint(keys: list[str]) -> str:
            return f"pass allow_changed={keys!r} to the trainer"

        changes = check_resume(self.offpolicy_resume_settings, stored.get("settings", {}),
                               allowed=self.offpolicy_allow_changed, where=f"resume_from_checkpoint {folder!r}",
                               step=step, allow_hint=hint)
        if self.args.should_save:
            record_changes(os.path.join(self.args.output_dir, CHANGES_FILE), changes, step=step, checkpoint=folder)


__all__ = ["ResumeCheck", "trl_recipe"]
