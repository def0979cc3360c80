"""verl's resume with the plug-in's settings (offpolicy.integrations.verl.resume): saved beside verl's checkpoint,
compared when verl resumes, refused or recorded.

A live verl run (Ray, vLLM, an FSDP actor) takes minutes on CPU, so the checkpoint folders here are written and read
by verl 0.9.1's *own* ``PPOTrainer._save_checkpoint`` / ``_load_checkpoint`` (its folder layout, its tracker file,
its ``resume_mode`` rules and ``find_latest_ckpt_path``), run on a host object whose workers are stubs: the actor's
``save_checkpoint`` writes a file, the dataloader state is a dict.
"""

from __future__ import annotations

import json
import os
import re

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")  # verl's v1 trainer imports it

from omegaconf import OmegaConf  # noqa: E402

from offpolicy.integrations.verl.driver import make_trainer_class  # noqa: E402
from offpolicy.resume_settings import CHANGES_FILE, SETTINGS_FILE, read_changes  # noqa: E402


class _Actor:
    def __init__(self) -> None:
        self.loaded: list[str] = []

    def save_checkpoint(self, local_path, remote_path, step, max_ckpt_to_keep=None):
        os.makedirs(local_path, exist_ok=True)
        with open(os.path.join(local_path, "model.pt"), "w") as f:
            f.write(str(step))

    def load_checkpoint(self, local_path, del_local_after_load=False):
        self.loaded.append(local_path)


class _Loader:
    def state_dict(self):
        return {"epoch": 0}

    def load_state_dict(self, state):
        self.state = state


class _Callback:
    def on_save(self, **kwargs):
        pass


def _host_class():
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    class Host:
        """verl's real save / load code on stub workers (see the module docstring)."""

        _save_checkpoint = PPOTrainer._save_checkpoint
        _load_checkpoint = PPOTrainer._load_checkpoint

        def __init__(self, config):
            self.config = config
            self.actor_rollout_wg, self.train_dataloader = _Actor(), _Loader()
            self.checkpoint_callback, self.use_critic, self.trainer_mode = _Callback(), False, "sync"
            self.global_steps = 0

    return make_trainer_class(Host)


def _config(folder, mode="auto", path=None):
    return OmegaConf.create({
        "trainer": {"default_local_dir": str(folder), "resume_mode": mode, "resume_from_path": path,
                    "default_hdfs_dir": None, "del_local_ckpt_after_load": False},
        "actor_rollout_ref": {"actor": {"checkpoint": {}}},
        "algorithm": {"rollout_correction": {"rollout_is": None, "rollout_rs": None}},
    })


@pytest.fixture
def trained(tmp_path, monkeypatch):
    """A run that saved verl checkpoints at steps 20 and 40 with correction tis upper 2.0."""
    monkeypatch.setenv("OFFPOLICY_VERL", "{correction: {name: tis, upper: 2.0}, sampling: {min_p: 1e-3}}")
    trainer = _host_class()(_config(tmp_path))
    for step in (20, 40):
        trainer.global_steps = step
        trainer._save_checkpoint()
    return tmp_path


def _resume(folder, monkeypatch, env, **config):
    monkeypatch.setenv("OFFPOLICY_VERL", env)
    trainer = _host_class()(_config(folder, **config))
    trainer._load_checkpoint()
    return trainer


def test_the_settings_lie_beside_verls_checkpoint(trained):
    assert (trained / "latest_checkpointed_iteration.txt").read_text() == "40"
    stored = json.loads((trained / "global_step_40" / SETTINGS_FILE).read_text())
    assert stored["step"] == 40 and stored["settings"]["correction.upper"] == 2.0
    assert stored["settings"]["sampling.min_p"] == 1e-3 and stored["settings"]["correction.name"] == "tis"
    assert (trained / "global_step_40" / "actor" / "model.pt").is_file()  # verl's own files, beside ours


def test_the_same_settings_resume(trained, monkeypatch):
    trainer = _resume(trained, monkeypatch, "{correction: {name: tis, upper: 2e0}, sampling: {min_p: 0.001}}")
    assert trainer.global_steps == 40 and trainer.actor_rollout_wg.loaded == [str(trained / "global_step_40" /
                                                                                   "actor")]
    assert not (trained / CHANGES_FILE).exists()


@pytest.mark.parametrize("env, named", [
    ("{correction: {name: tis, upper: 3.0}, sampling: {min_p: 1e-3}}",
     "correction.upper is 3.0 here but 2.0 in the checkpoint (step 40); set allow_changed: [correction.upper] in "
     "OFFPOLICY_VERL to resume with the new value"),
    ("{correction: {name: tis, upper: 2.0}}", "sampling.min_p is None here but 0.001 in the checkpoint"),
    ("{correction: [{name: tis, upper: 2.0}, {name: opsm}], sampling: {min_p: 1e-3}}",
     "correction[0].name is 'tis' here but unset in the checkpoint"),
])
def test_a_changed_setting_is_refused_before_verl_loads(env, named, trained, monkeypatch):
    with pytest.raises(ValueError, match=re.escape(named)) as err:
        _resume(trained, monkeypatch, env)
    assert str(err.value).startswith("OFFPOLICY_VERL: trainer.resume_mode=auto from ") and "\n" not in str(err.value)
    assert not (trained / CHANGES_FILE).exists()


def test_an_allowed_change_is_recorded_and_saved_with_the_next_checkpoint(trained, monkeypatch):
    env = "{correction: {name: tis, upper: 3.0}, sampling: {min_p: 1e-3}, allow_changed: [correction.upper]}"
    trainer = _resume(trained, monkeypatch, env)
    assert trainer.global_steps == 40
    rows = read_changes(trained / CHANGES_FILE)
    assert [(r["step"], r["key"], r["old"], r["new"]) for r in rows] == [(40, "correction.upper", 2.0, 3.0)]
    trainer.global_steps = 60
    trainer._save_checkpoint()
    assert json.loads((trained / "global_step_60" / SETTINGS_FILE).read_text())["settings"]["correction.upper"] == 3.0


def test_resume_path_is_compared_with_the_folder_it_names(trained, monkeypatch):
    # resume_mode=resume_path loads global_step_20 — compared with that folder's settings, not the latest's
    env = "{correction: {name: tis, upper: 3.0}, sampling: {min_p: 1e-3}}"
    with pytest.raises(ValueError, match=r"global_step_20: correction\.upper is 3\.0 here but 2\.0 in the checkpoint "
                                         r"\(step 20\)"):
        _resume(trained, monkeypatch, env, mode="resume_path", path=str(trained / "global_step_20"))
    trainer = _resume(trained, monkeypatch, env, mode="disable")  # a fresh start: nothing to compare
    assert trainer.global_steps == 0


def test_a_folder_without_settings_resumes_with_a_warning(trained, monkeypatch):
    (trained / "global_step_40" / SETTINGS_FILE).unlink()
    with pytest.warns(UserWarning, match="holds no offpolicy_settings.json"):
        trainer = _resume(trained, monkeypatch, "{correction: {name: tis, upper: 3.0}}")
    assert trainer.global_steps == 40
