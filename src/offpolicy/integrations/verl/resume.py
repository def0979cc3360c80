"""verl's resume and the plug-in's settings: stored beside each checkpoint, compared when verl resumes from one.

verl 0.9's v1 trainer saves ``trainer.default_local_dir/global_step_N/`` (``actor/``, ``data.pt``) and then names it
in ``latest_checkpointed_iteration.txt``; on start, ``trainer.resume_mode`` (``auto``: that latest folder;
``resume_path``: ``trainer.resume_from_path``; ``disable``) picks the folder ``_load_checkpoint`` restores. verl
keeps nothing of ``OFFPOLICY_VERL`` there, so a run resumed with another correction threshold or sampling recipe
would continue silently. The plug-in's trainer (:class:`~offpolicy.integrations.verl.driver.OffPolicyTrainerMixin`)
therefore writes :data:`~offpolicy.resume_settings.SETTINGS_FILE` into ``global_step_N/`` before verl's own save
(the tracker names a folder only once it holds them) and, before verl's ``_load_checkpoint``, compares the folder
verl will load with the run's settings (:func:`check_on_resume`): a difference is refused naming each key with both
values, unless ``OFFPOLICY_VERL``'s ``allow_changed`` names it; allowed changes are appended to
``default_local_dir/offpolicy_settings_changes.jsonl``.

The keys (:func:`recipe_settings`): the correction's effective parameters (``correction.upper``,
``correction[1].delta``), ``sampling.*``, ``alp.*``, ``topk_logprobs``, ``topk_bound``, ``score_centering`` — not
``naming`` or ``sync_check``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from offpolicy.integrations.verl.settings import ENV_VAR, VerlSettings
from offpolicy.registry import build_correction
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


def recipe_settings(settings: VerlSettings) -> dict[str, Any]:
    """The plug-in's settings a resume must keep, flat (see the module docstring).

    >>> from offpolicy.integrations.verl.settings import parse_settings
    >>> recipe_settings(parse_settings({"correction": {"name": "opsm", "delta": 0.5}}))["correction.delta"]
    0.5
    """
    alp = settings.alp
    flat = correction_settings(build_correction(settings.correction))
    flat.update(flatten({
        "sampling": {"min_p": settings.sampling.min_p, "top_k": settings.sampling.top_k,
                     "top_p": settings.sampling.top_p},
        "alp": None if alp is None else {"init_std": alp.init_std, "lr": alp.lr, "layers": alp.layers,
                                         "seed": alp.seed},
        "topk_logprobs": settings.topk_logprobs, "topk_bound": settings.topk_bound,
        "score_centering": settings.score_centering,
    }))
    return flat


def _absolute(path: str) -> str:
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def resume_folder(config: Any) -> str | None:
    """The ``global_step_N`` folder verl's v1 ``_load_checkpoint`` will restore under ``config.trainer`` (its
    ``resume_mode`` rules, verl's own ``find_latest_ckpt_path``), or None when it starts from scratch."""
    trainer = config.trainer
    mode = trainer.get("resume_mode", "auto")
    if mode == "auto":
        from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

        return find_latest_ckpt_path(_absolute(str(trainer.default_local_dir)))
    if mode == "resume_path" and isinstance(trainer.get("resume_from_path"), str):
        return _absolute(trainer.resume_from_path)
    return None  # disable (or a mode verl itself rejects)


def save_settings(config: Any, step: int, settings: VerlSettings) -> str:
    """Write the settings into ``default_local_dir/global_step_{step}/`` (atomically); returns the file's path."""
    path = os.path.join(str(config.trainer.default_local_dir), f"global_step_{step}", SETTINGS_FILE)
    write_json_atomic(path, {"step": step, "settings": recipe_settings(settings)})
    return path


def check_on_resume(config: Any, settings: VerlSettings) -> list[dict[str, Any]]:
    """Before verl resumes: refuse settings that differ from those stored in the folder it will load (one line
    naming each key, both values and ``allow_changed``), record the allowed ones; returns them. A folder written
    without the plug-in's settings (an older plug-in, or verl alone) is resumed with one warning."""
    folder = resume_folder(config)
    if folder is None:
        return []
    stored = read_settings(os.path.join(folder, SETTINGS_FILE))
    if stored is None:
        warnings.warn(f"{ENV_VAR}: checkpoint {folder!r} holds no {SETTINGS_FILE} (written without the plug-in's "
                      "settings): resuming without comparing them", stacklevel=2)
        return []
    step = int(str(folder).rstrip("/").rsplit("global_step_", 1)[-1])
    mode = config.trainer.get("resume_mode", "auto")

    def hint(keys: list[str]) -> str:
        return f"set allow_changed: [{', '.join(keys)}] in {ENV_VAR}"

    changes = check_resume(recipe_settings(settings), stored.get("settings", {}), allowed=settings.allow_changed,
                           where=f"{ENV_VAR}: trainer.resume_mode={mode} from {folder}", step=step, allow_hint=hint)
    record_changes(os.path.join(str(config.trainer.default_local_dir), CHANGES_FILE), changes, step=step,
                   checkpoint=str(folder))
    return changes


__all__ = ["check_on_resume", "recipe_settings", "resume_folder", "save_settings"]
