"""The limit on non-finite μ as each host's own setting: the reference trainer's ``rollout.max_nonfinite_rollout``,
``OffPolicyGRPOTrainer(max_nonfinite_rollout=...)`` and ``OFFPOLICY_VERL``'s ``max_nonfinite_rollout``, each
validated (a share in [0, 1], one line naming the key), each reaching the batches the host builds, and a batch past
it refused naming that key (with the environment's variable only while the key is unset)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch
from offpolicy_testkit.trl_toy import toy_step_inputs

from offpolicy.batch import nonfinite_fields

NAN = float("nan")


@pytest.fixture(autouse=True)
def _no_environment_limit(monkeypatch):
    monkeypatch.delenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", raising=False)
    monkeypatch.delenv("OFFPOLICY_VERL", raising=False)


def _mu_one_bad_of_five():
    """TRL's toy batch (5 valid tokens) with one μ NaN: 20 % of the valid tokens."""
    inputs = toy_step_inputs()
    inputs["sampling_per_token_logps"] = inputs["sampling_per_token_logps"].clone()
    inputs["sampling_per_token_logps"][0, 1] = NAN
    return inputs


def test_unset_is_the_default_and_names_the_environment_too(monkeypatch):
    assert nonfinite_fields(None, setting="k") == {"max_nonfinite_rollout": 1e-3,
                                                   "nonfinite_setting": "k / OFFPOLICY_MAX_NONFINITE_ROLLOUT"}
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "0.25")
    assert nonfinite_fields(None, setting="k")["max_nonfinite_rollout"] == 0.25
    assert nonfinite_fields(0.5, setting="k") == {"max_nonfinite_rollout": 0.5, "nonfinite_setting": "k"}
    for bad in (-0.1, 1.5, NAN, "0.1", True):
        with pytest.raises(ValueError, match=r"^k must be a share in \[0, 1\] \(1: no limit\) or unset, got"):
            nonfinite_fields(bad, setting="k")


# -- the reference trainer ------------------------------------------------------------------------------------------


def _trainer_batch(cfg, rollout_logp):
    from offpolicy.train.update import _minibatch

    b, t = rollout_logp.shape
    scored = NS(theta=(torch.zeros(b, t), {}), mask=torch.ones(b, t, dtype=torch.bool), old_logp=torch.zeros(b, t),
                rollout_logp=rollout_logp, token_divergence=None)
    return _minibatch(NS(cfg=cfg), NS(advantages=torch.ones(b)), scored, torch.arange(b))


def test_the_reference_trainers_setting_reaches_its_batches_and_names_its_key(tmp_path):
    from offpolicy.train.config import load_config

    mu = torch.tensor([[-1.0, NAN, -0.5, -0.2, -0.1]])  # 1 of 5 valid tokens
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "rollout.max_nonfinite_rollout=0.25"])
    batch = _trainer_batch(cfg, mu)
    assert (batch.max_nonfinite_rollout, batch.nonfinite_setting) == (0.25, "rollout.max_nonfinite_rollout")
    strict = load_config(None, [f"run.out_dir={tmp_path}", "rollout.max_nonfinite_rollout=0.1"])
    with pytest.raises(ValueError, match=r"above max_nonfinite_rollout = 0.1: .*raise the limit with "
                                         r"rollout.max_nonfinite_rollout$"):
        _trainer_batch(strict, mu)
    with pytest.raises(ValueError, match=r"raise the limit with rollout.max_nonfinite_rollout / "
                                         r"OFFPOLICY_MAX_NONFINITE_ROLLOUT$"):  # unset: 1e-3, from the environment
        _trainer_batch(load_config(None, [f"run.out_dir={tmp_path}"]), mu)
    for bad, why in (("1.5", "less than or equal to 1"), ("-0.1", "greater than or equal to 0")):
        with pytest.raises(ValueError, match=f"^invalid config: rollout.max_nonfinite_rollout: Input should be {why}$"):
            load_config(None, [f"run.out_dir={tmp_path}", f"rollout.max_nonfinite_rollout={bad}"])


# -- TRL ------------------------------------------------------------------------------------------------------------


class _StandInGRPOTrainer:
    """The members of trl.GRPOTrainer (1.16) the loss relies on, over a per-token log-prob table."""

    def __init__(self, *, args=None, table=None):
        from collections import defaultdict

        self.args = args or NS(use_vllm=True, vllm_importance_sampling_correction=False, beta=0.0, epsilon=0.2,
                               epsilon_high=0.28)
        self.table = table
        self.current_gradient_accumulation_steps = 1
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return self.table, None, None


def test_trls_keyword_reaches_the_loss_batch_and_names_itself():
    from offpolicy.integrations.trl import OffPolicyGRPOMixin

    cls = type("OffPolicyGRPOTrainer", (OffPolicyGRPOMixin, _StandInGRPOTrainer), {})
    lp = torch.tensor([[-0.9, -2.1, -0.4], [-1.1, -0.9, 0.0]], requires_grad=True)
    model = torch.nn.Linear(1, 1).train()
    loss = cls(table=lp, max_nonfinite_rollout=0.25)._compute_loss(model, _mu_one_bad_of_five())
    assert torch.isfinite(loss)  # 20 % ≤ 25 %: the token left out, the loss finite
    with pytest.raises(ValueError, match=r"above max_nonfinite_rollout = 0.1: .*raise the limit with "
                                         r"OffPolicyGRPOTrainer\(max_nonfinite_rollout=\.\.\.\)$"):
        cls(table=lp, max_nonfinite_rollout=0.1)._compute_loss(model, _mu_one_bad_of_five())
    with pytest.raises(ValueError, match=r"OffPolicyGRPOTrainer\(max_nonfinite_rollout=\.\.\.\) / "
                                         r"OFFPOLICY_MAX_NONFINITE_ROLLOUT$"):  # unset: the default 1e-3
        cls(table=lp)._compute_loss(model, _mu_one_bad_of_five())
    with pytest.raises(ValueError, match=r"^max_nonfinite_rollout must be a share in \[0, 1\]"):
        cls(table=lp, max_nonfinite_rollout=2)


# -- verl -----------------------------------------------------------------------------------------------------------


def test_verls_block_validates_the_key():
    from offpolicy.integrations.verl.settings import parse_settings

    assert parse_settings({"max_nonfinite_rollout": 0.01}).max_nonfinite_rollout == 0.01
    assert parse_settings({}).max_nonfinite_rollout is None
    for bad, why in ((1.5, "a real number in"), ("0.1", "a real number,"), (True, "a real number,")):
        with pytest.raises(ValueError, match=f"^OFFPOLICY_VERL: max_nonfinite_rollout must be {why}"):
            parse_settings({"max_nonfinite_rollout": bad})


def test_verls_driver_correction_reads_the_block_and_names_the_key():
    from offpolicy.integrations.verl.driver import apply_driver_correction
    from offpolicy.integrations.verl.settings import parse_settings

    inputs = _mu_one_bad_of_five()
    batch = {"old_log_probs": inputs["old_per_token_logps"], "rollout_log_probs": inputs["sampling_per_token_logps"],
             "response_mask": inputs["completion_mask"], "advantages": torch.ones(2, 3)}
    loose = parse_settings({"correction": {"name": "tis", "upper": 2.0}, "max_nonfinite_rollout": 0.25})
    updates, _ = apply_driver_correction(dict(batch), loose)
    assert not bool(updates["response_mask"][0, 1])  # the NaN token left out
    strict = parse_settings({"correction": {"name": "tis", "upper": 2.0}, "max_nonfinite_rollout": 0.1})
    with pytest.raises(ValueError, match=r"raise the limit with OFFPOLICY_VERL: max_nonfinite_rollout$"):
        apply_driver_correction(dict(batch), strict)


def test_verls_worker_loss_reads_the_block_from_the_environment(monkeypatch):
    from offpolicy.integrations.verl.loss import rollout_log_probs_in_loss, verl_policy_loss_fn

    inputs = _mu_one_bad_of_five()
    args = (inputs["old_per_token_logps"], inputs["old_per_token_logps"].clone().requires_grad_(),
            torch.ones(2, 3), inputs["completion_mask"].float(), "token-mean", {"clip_ratio": 0.2})
    fn = verl_policy_loss_fn(objective="ipo")  # an objective that reads μ
    monkeypatch.setenv("OFFPOLICY_VERL", "{max_nonfinite_rollout: 0.25}")
    with rollout_log_probs_in_loss(inputs["sampling_per_token_logps"]):
        loss, _ = fn(*args)
    assert torch.isfinite(loss)
    monkeypatch.setenv("OFFPOLICY_VERL", "{max_nonfinite_rollout: 0.1}")
    with rollout_log_probs_in_loss(inputs["sampling_per_token_logps"]), pytest.raises(
            ValueError, match=r"raise the limit with OFFPOLICY_VERL: max_nonfinite_rollout$"):
        fn(*args)
    with pytest.raises(ValueError, match=r"^max_nonfinite_rollout must be a share in \[0, 1\]"):
        verl_policy_loss_fn(max_nonfinite_rollout=-1)
