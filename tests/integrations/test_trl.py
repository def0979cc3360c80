"""TRL adapter: key mapping, loss equality with offpolicy.policy_loss, and the GRPOTrainer subclass on a stand-in base."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.importance import tis
from offpolicy.integrations.trl import batch_from_trl_inputs, make_offpolicy_grpo_trainer, trl_policy_loss
from offpolicy.losses import policy_loss


def _inputs():
    return {
        "prompt_ids": torch.tensor([[5, 6], [5, 7]]),
        "prompt_mask": torch.ones(2, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[1, 2, 3], [1, 2, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "advantages": torch.tensor([1.0, -1.0]),
        "old_per_token_logps": torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]]),
        "sampling_per_token_logps": torch.tensor([[-1.5, -2.0, -0.5], [-0.2, -1.0, 0.0]]),
    }


def test_key_mapping():
    inputs = _inputs()
    b = batch_from_trl_inputs(torch.zeros(2, 3), inputs)
    assert torch.equal(b.rollout_logp, inputs["sampling_per_token_logps"])
    assert torch.equal(b.old_logp, inputs["old_per_token_logps"])
    # without vLLM log-probs, μ = π_old
    inputs.pop("sampling_per_token_logps")
    assert torch.equal(batch_from_trl_inputs(torch.zeros(2, 3), inputs).rollout_logp, inputs["old_per_token_logps"])
    # tool_mask removes tool-output tokens
    inputs["tool_mask"] = torch.tensor([[1, 0, 1], [1, 1, 1]])
    assert batch_from_trl_inputs(torch.zeros(2, 3), inputs).bool_mask.tolist() == [[True, False, True], [True, True, False]]
    with pytest.raises(ValueError, match="advantages"):
        batch_from_trl_inputs(torch.zeros(2, 3), {"completion_mask": torch.ones(2, 3)})


def test_loss_equals_policy_loss():
    inputs = _inputs()
    lp = torch.tensor([[-0.9, -2.1, -0.4], [-1.1, -0.9, 0.0]], requires_grad=True)
    got, _ = trl_policy_loss(lp, inputs, correction=tis(upper=2.0), clip_high=0.28)
    want, _ = policy_loss(
        LogProbBatch(logp=lp, mask=inputs["completion_mask"], old_logp=inputs["old_per_token_logps"],
                     rollout_logp=inputs["sampling_per_token_logps"], advantages=inputs["advantages"]),
        correction=tis(upper=2.0), clip_high=0.28,
    )
    assert torch.equal(got, want)


class _StandInGRPOTrainer:
    """The two members of trl.GRPOTrainer the subclass relies on, over a per-token log-prob table."""

    def __init__(self, *, args=None, table=None):
        self.args = args or SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=False, beta=0.0,
                                            epsilon=0.2, epsilon_high=0.28)
        self.table = table
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep):
        assert input_ids.shape[1] == attention_mask.shape[1] == 2 + logits_to_keep
        return self.table, None, None


def test_subclass_computes_offpolicy_loss_and_logs_metrics():
    lp = torch.tensor([[-0.9, -2.1, -0.4], [-1.1, -0.9, 0.0]], requires_grad=True)
    cls = make_offpolicy_grpo_trainer(_StandInGRPOTrainer)
    trainer = cls(table=lp, correction=tis(upper=2.0))
    model = torch.nn.Linear(1, 1).train()
    loss = trainer._compute_loss(model, _inputs())
    want, _ = trl_policy_loss(lp, _inputs(), correction=tis(upper=2.0), clip_low=0.2, clip_high=0.28)
    assert torch.equal(loss, want)
    assert "offpolicy/loss/clipfrac_high" in trainer._metrics["train"]
    loss.backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()


def test_subclass_refuses_double_correction_and_kl_term():
    cls = make_offpolicy_grpo_trainer(_StandInGRPOTrainer)
    double = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True, beta=0.0, epsilon=0.2)
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction"):
        cls(args=double, correction=tis())
    with pytest.raises(ValueError, match="beta"):
        cls(args=SimpleNamespace(use_vllm=False, beta=0.04, epsilon=0.2))


@pytest.mark.slow
def test_real_grpo_trainer_two_steps(tmp_path):
    """The subclass trains inside TRL's real GRPOTrainer (skipped when TRL is not installed)."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl import GRPOConfig

    from offpolicy.integrations.trl import OffPolicyGRPOTrainer
    from offpolicy.models.tiny import build_tiny_model

    model, tokenizer = build_tiny_model(seed=0)
    data = datasets.Dataset.from_list([{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)])

    def reward(completions, answer, **kwargs):
        return [float(c.strip().startswith(a)) for c, a in zip(completions, answer)]

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
                      max_steps=2, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no", beta=0.0)
    trainer = OffPolicyGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                                   processing_class=tokenizer, correction=tis(upper=2.0))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "offpolicy/tis/kept_frac" in h]
    assert len(logged) == 2
    # no vLLM: μ = π_old = π_θ, so the correction is the identity
    assert all(h["offpolicy/tis/kept_frac"] == 1.0 and h["offpolicy/loss/ratio_mean"] == 1.0 for h in logged)
