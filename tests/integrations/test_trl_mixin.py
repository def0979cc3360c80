"""``OffPolicyGRPOMixin`` composed in front of a user's own ``GRPOTrainer`` subclass: the user's overrides and
offpolicy's both run (on a stand-in base, and in TRL's real ``train()`` on a tiny random Qwen2); the module-level
``OffPolicyGRPOTrainer`` is that composition with TRL's ``GRPOTrainer``."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from offpolicy_testkit.trl_toy import toy_step_inputs as _inputs

from offpolicy.corrections.importance import tis
from offpolicy.integrations.trl import OffPolicyGRPOMixin, trl_policy_loss


class _StandInGRPOTrainer:
    """The members of trl.GRPOTrainer (1.16) the mixin relies on, over a per-token log-prob table."""

    def __init__(self, *, args=None, table=None):
        self.args = args or SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=False, beta=0.0,
                                            epsilon=0.2, epsilon_high=0.28)
        self.table = table
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           compute_entropy=False, compute_aux_loss=False, **model_inputs):
        return self.table, None, None


class _UserTrainer(_StandInGRPOTrainer):
    """A user's GRPOTrainer subclass: counts its own forwards (which offpolicy's loss calls)."""

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        self.forwards = getattr(self, "forwards", 0) + 1
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)


class _Mine(OffPolicyGRPOMixin, _UserTrainer):
    pass


def test_the_mixin_in_front_of_a_users_subclass_on_a_stand_in():
    lp = torch.tensor([[-0.9, -2.1, -0.4], [-1.1, -0.9, 0.0]], requires_grad=True)
    trainer = _Mine(table=lp, correction=tis(upper=2.0))
    loss = trainer._compute_loss(torch.nn.Linear(1, 1).train(), _inputs())
    want, _ = trl_policy_loss(lp, _inputs(), correction=tis(upper=2.0), clip_low=0.2, clip_high=0.28)
    assert torch.equal(loss, want)  # offpolicy's loss …
    assert trainer.forwards == 1  # … through the user's own forward override
    assert "offpolicy/loss/clipfrac_high" in trainer._metrics["train"]
    # the mixin's settings are checked before the user's constructor runs
    with pytest.raises(ValueError, match="topk_bound"):
        _Mine(table=lp, topk_bound="exact")
    # the parts come before the user's class in the method resolution order, TRL's methods after it
    mro = _Mine.__mro__
    assert mro.index(OffPolicyGRPOMixin) < mro.index(_UserTrainer) < mro.index(_StandInGRPOTrainer)


trl = pytest.importorskip("trl")


def test_the_module_level_trainer_is_the_mixin_in_front_of_grpo_trainer():
    from offpolicy.integrations import trl as adapter
    from offpolicy.integrations.trl.grpo import OffPolicyGRPOTrainer

    assert adapter.OffPolicyGRPOTrainer is OffPolicyGRPOTrainer
    assert OffPolicyGRPOTrainer.__bases__ == (OffPolicyGRPOMixin, trl.GRPOTrainer)
    assert OffPolicyGRPOTrainer.__qualname__ == "OffPolicyGRPOTrainer"  # not a class built inside a function


@pytest.mark.slow
def test_the_mixin_in_front_of_a_users_grpo_trainer_in_trls_train(tmp_path):
    datasets = pytest.importorskip("datasets")  # noqa: F841 - TRL's toy dataset needs it
    if not trl.__version__.startswith("1.16"):
        pytest.skip(f"overrides TRL 1.16's internal methods; installed {trl.__version__}")
    from offpolicy_testkit.trl_toy import logged, toy_dataset, varied_reward
    from trl import GRPOConfig, GRPOTrainer

    from offpolicy.models.tiny import build_tiny_model

    class MyGRPOTrainer(GRPOTrainer):  # the user's own: records every generation batch's size
        batches: list

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.batches.append(int(out["completion_ids"].shape[0]))
            return out

    class Mine(OffPolicyGRPOMixin, MyGRPOTrainer):
        pass

    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=0)
    Mine.batches = []
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=2, report_to=[], use_cpu=True, bf16=False, logging_steps=1,
                      save_strategy="no", beta=0.0, seed=0, temperature=0.7)
    trainer = Mine(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(),
                   processing_class=tok, sampling_replay=True)
    trainer.train()
    assert trainer.batches == [4, 4]  # the user's override ran on every generation batch
    assert logged(trainer, "offpolicy/dvp_keep/masked_frac") == [0.0, 0.0]  # offpolicy's replay and loss ran too
    assert len(logged(trainer, "offpolicy/loss/ratio_mean")) == 2
