"""TRL's ``train(resume_from_checkpoint=...)`` with offpolicy's method settings
(offpolicy.integrations.trl.parts.resume): saved in TRL's own ``checkpoint-N`` folder by TRL's save, compared on
resume, refused or recorded. A live TRL 1.16 ``GRPOTrainer.train()`` on a tiny random model, one step per run."""

import json
import re

import pytest

from offpolicy.models.tiny import build_tiny_model
from offpolicy.registry import build_correction
from offpolicy.resume_settings import CHANGES_FILE, SETTINGS_FILE, read_changes

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
if not trl.__version__.startswith("1.16"):
    pytest.skip(f"overrides TRL 1.16's internal methods; installed {trl.__version__}", allow_module_level=True)

from offpolicy_testkit.trl_toy import toy_dataset, varied_reward  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from offpolicy.integrations.trl import OffPolicyGRPOTrainer  # noqa: E402
from offpolicy.integrations.trl.parts.resume import trl_recipe  # noqa: E402


def _trainer(tmp_path, max_steps, **kw):
    model, tok = build_tiny_model(seed=0)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=max_steps, report_to=[], use_cpu=True, bf16=False,
                      logging_steps=1, save_strategy="steps", save_steps=1, beta=0.0, seed=0)
    return OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(),
                                processing_class=tok, **kw)


def test_resume_refuses_changed_settings_and_records_allowed_ones(tmp_path):
    _trainer(tmp_path, 1, clip_high=0.28).train()
    ckpt = tmp_path / "checkpoint-1"
    stored = json.loads((ckpt / SETTINGS_FILE).read_text())
    assert (ckpt / "trainer_state.json").is_file()  # TRL's own checkpoint, with the settings beside it
    assert stored["step"] == 1 and stored["settings"]["objective.clip_high"] == 0.28
    # Expected: a resume with another clip range stops before TRL loads or trains anything, naming both values
    with pytest.raises(ValueError, match=re.escape(
            f"resume_from_checkpoint '{ckpt}': objective.clip_high is 0.3 here but 0.28 in the checkpoint (step 1); "
            "pass allow_changed=['objective.clip_high'] to the trainer to resume with the new value")):
        _trainer(tmp_path, 2, clip_high=0.3).train(resume_from_checkpoint=True)
    assert not (tmp_path / "checkpoint-2").exists() and not (tmp_path / CHANGES_FILE).exists()
    resumed = _trainer(tmp_path, 2, clip_high=0.3, allow_changed=["objective.clip_high"])
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 2
    rows = read_changes(tmp_path / CHANGES_FILE)
    assert [(r["step"], r["key"], r["old"], r["new"]) for r in rows] == [(1, "objective.clip_high", 0.28, 0.3)]
    assert json.loads((tmp_path / "checkpoint-2" / SETTINGS_FILE).read_text())["settings"]["objective.clip_high"] == 0.3


def test_the_recipe_holds_the_corrections_effective_thresholds():
    loss = {"objective": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28}, "aggregation": "token_mean"}
    chain = build_correction([{"name": "tis", "upper": 3.0}, {"name": "opsm", "delta": 1e-4}])
    flat = trl_recipe(chain, loss, replay=False, dvp_rho=None, alp={"init_std": 0.05}, topk_logprobs=0,
                      topk_bound="upper", score_centering=False)
    assert flat["correction[0].upper"] == 3.0 and flat["correction[0].level"] == "token"  # defaults included
    assert flat["correction[1].delta"] == 1e-4 and flat["alp.init_std"] == 0.05 and flat["alp.seed"] is None
    single = trl_recipe(build_correction({"name": "tis", "upper": 2.0}), loss, replay=True, dvp_rho=0.01, alp=None,
                        topk_logprobs=4, topk_bound="lower", score_centering=False)
    assert single["correction.upper"] == 2.0 and single["dvp_rho"] == 0.01 and single["alp"] is None


def test_allow_changed_must_name_settings(tmp_path):
    with pytest.raises(ValueError, match="allow_changed must be a list of setting names"):
        _trainer(tmp_path, 1, allow_changed="objective.clip_high")
