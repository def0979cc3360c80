"""TRL adapter: key mapping, loss equality with offpolicy.policy_loss, and the GRPOTrainer subclass on a stand-in base."""

import functools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from offpolicy_testkit.trl_toy import loss_and_grad
from offpolicy_testkit.trl_toy import toy_step_inputs as _inputs

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.importance import tis
from offpolicy.integrations.trl import OffPolicyGRPOMixin, batch_from_trl_inputs, trl_policy_loss
from offpolicy.losses import policy_loss


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
    """The members of trl.GRPOTrainer (1.16) the subclass relies on, over a per-token log-prob table."""

    def __init__(self, *, args=None, table=None, accumulation=1):
        self.args = args or SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=False, beta=0.0,
                                            epsilon=0.2, epsilon_high=0.28)
        self.table = table
        self.current_gradient_accumulation_steps = accumulation
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           compute_entropy=False, compute_aux_loss=False, **model_inputs):
        assert input_ids.shape[1] == attention_mask.shape[1] == 2 + logits_to_keep
        return self.table, None, None


class _Trainer(OffPolicyGRPOMixin, _StandInGRPOTrainer):
    """The mixin in front of the stand-in, as ``OffPolicyGRPOTrainer`` is in front of ``GRPOTrainer``."""


def test_subclass_computes_offpolicy_loss_and_logs_metrics():
    lp = torch.tensor([[-0.9, -2.1, -0.4], [-1.1, -0.9, 0.0]], requires_grad=True)
    cls = _Trainer
    trainer = cls(table=lp, correction=tis(upper=2.0))
    model = torch.nn.Linear(1, 1).train()
    loss = trainer._compute_loss(model, _inputs())
    want, _ = trl_policy_loss(lp, _inputs(), correction=tis(upper=2.0), clip_low=0.2, clip_high=0.28)
    assert torch.equal(loss, want)
    assert "offpolicy/loss/clipfrac_high" in trainer._metrics["train"]
    loss.backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()


def _args(**kw):
    base = dict(use_vllm=True, vllm_importance_sampling_correction=False, beta=0.0, epsilon=0.2, epsilon_high=0.28,
                loss_type="bnpo", max_completion_length=3, steps_per_generation=4, delta=None,
                importance_sampling_level="token", top_entropy_quantile=1.0, off_policy_mask_threshold=None,
                entropy_coef=0.0)
    return SimpleNamespace(**{**base, **kw})


def test_corrections_and_objectives_by_name_and_the_mismatch_metrics_under_trls_names():
    # A correction spec by name gives the same loss as the object; TRL's loss_type cispo maps to the cispo objective
    # with TRL's cap (weight = min(r, epsilon_high)); the mismatch diagnostics use TRL's sampling/… names
    lp = torch.tensor([[-0.9, -2.1, -0.4], [-1.1, -0.9, 0.0]], requires_grad=True)
    cls = _Trainer
    by_name = cls(table=lp, correction=[{"name": "tis", "upper": 2.0}])
    assert torch.equal(by_name._compute_loss(torch.nn.Linear(1, 1).train(), _inputs()),
                       cls(table=lp, correction=tis(upper=2.0))._compute_loss(torch.nn.Linear(1, 1).train(), _inputs()))
    logged = by_name._metrics["train"]
    # |log π_old − log μ| over the 5 valid tokens: (0.5 + 0 + 0 + 0.8 + 0) / 5 = 0.26, max 0.8
    assert logged["sampling/sampling_logp_difference/mean"] == [pytest.approx(0.26)]
    assert logged["sampling/sampling_logp_difference/max"] == [pytest.approx(0.8)]
    assert "sampling/importance_sampling_ratio/mean" in logged and "sampling/kl" in logged
    verl_names = cls(table=lp, metric_naming="verl")
    verl_names._compute_loss(torch.nn.Linear(1, 1).train(), _inputs())
    assert "rollout_corr/kl" in verl_names._metrics["train"] and "rollout_corr/chi2_seq" in verl_names._metrics["train"]
    with pytest.raises(ValueError, match="naming"):
        cls(table=lp, metric_naming="wandb")
    cispo = cls(args=_args(loss_type="cispo", epsilon_high=5.0), table=lp)
    assert cispo.offpolicy_loss_kwargs["objective"] == {"name": "cispo", "clip_low": 1.0, "clip_high": 4.0}
    sapo = cls(args=_args(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05), table=lp)
    assert sapo.offpolicy_loss_kwargs == {"objective": {"name": "sapo", "tau_pos": 1.0, "tau_neg": 1.05},
                                          "aggregation": "seq_mean_token_mean"}


@pytest.mark.parametrize(
    "kw, trainer_kw, name",
    [
        # TRL's own vLLM IS beside an offpolicy correction: the mismatch corrected twice
        (dict(vllm_importance_sampling_correction=True), dict(correction="icepop"),
         "correction=.*vllm_importance_sampling_correction"),
        (dict(importance_sampling_level="sequence", loss_type="sapo"), {}, "importance_sampling_level.*sapo"),
        (dict(importance_sampling_level="sequence"), dict(objective="dppo_tv"), "importance_sampling_level.*dppo_tv"),
        (dict(loss_type="ppo2"), {}, "loss_type"),
        (dict(delta=0.9), {}, "delta"),
    ],
)
def test_subclass_refuses_only_contradictions(kw, trainer_kw, name):
    cls = _Trainer
    with pytest.raises(ValueError, match=name):
        cls(args=_args(**kw), **trainer_kw)


@pytest.mark.parametrize("kw", [
    dict(vllm_importance_sampling_correction=True), dict(beta=0.04), dict(loss_type="vespo"),
    dict(loss_type="luspo", importance_sampling_level="sequence"), dict(importance_sampling_level="sequence"),
    dict(top_entropy_quantile=0.2), dict(off_policy_mask_threshold=0.5), dict(entropy_coef=0.1),
    dict(loss_type="cispo", epsilon_high=None),
])
def test_subclass_accepts_trls_options(kw):
    # each is reproduced (tests/integrations/test_trl_options.py trains them beside vanilla TRL)
    _Trainer(args=_args(**kw))


def _batch(inputs, table):
    return LogProbBatch(logp=table, mask=inputs["completion_mask"], old_logp=inputs["old_per_token_logps"],
                        rollout_logp=inputs["sampling_per_token_logps"], advantages=inputs["advantages"])


@pytest.mark.parametrize(
    "loss_type, aggregation, max_tokens",
    [("bnpo", "token_mean", None), ("grpo", "seq_mean_token_mean", None), ("dr_grpo", "seq_mean_token_sum_norm", 3)],
)
def test_loss_types_and_gradient_accumulation_scale_as_trl(loss_type, aggregation, max_tokens):
    # TRL divides the micro-batch loss by the accumulation steps itself (the HF Trainer does not): 4 steps → 1/4
    lp = torch.tensor([[-0.9, -2.1, -0.4], [-1.1, -0.9, 0.0]], requires_grad=True)
    cls = _Trainer
    trainer = cls(args=_args(loss_type=loss_type, max_completion_length=3), table=lp, accumulation=4)
    got = trainer._compute_loss(torch.nn.Linear(1, 1).train(), _inputs())
    kw = {} if max_tokens is None else {"max_tokens": max_tokens}
    want, _ = policy_loss(_batch(_inputs(), lp), aggregation=aggregation, clip_low=0.2, clip_high=0.28, **kw)
    torch.testing.assert_close(got, want / 4)
    # in eval there is no accumulation
    got_eval = trainer._compute_loss(torch.nn.Linear(1, 1).eval(), _inputs())
    torch.testing.assert_close(got_eval, want)


def test_dr_grpo_divides_by_max_completion_length_not_the_padded_width():
    # 3 padded tokens, max_completion_length 6: Σ m·L / (B · 6), half of Σ m·L / (B · 3)
    lp = torch.tensor([[-0.9, -2.1, -0.4], [-1.1, -0.9, 0.0]], requires_grad=True)
    trainer = _Trainer(args=_args(loss_type="dr_grpo", max_completion_length=6),
                                                               table=lp)
    got = trainer._compute_loss(torch.nn.Linear(1, 1).train(), _inputs())
    padded, _ = policy_loss(_batch(_inputs(), lp), aggregation="seq_mean_token_sum_norm", clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(got, padded / 2)


def test_dapo_divides_the_sum_by_the_generation_batch_token_count():
    # TRL: Σ_micro-batch m·L / (num_items_in_batch / processes · accumulation / steps_per_generation)
    # here: 5 valid tokens; num_items_in_batch = 20, 1 process, accumulation 2, steps_per_generation 4 → divisor 10
    lp = torch.tensor([[-0.9, -2.1, -0.4], [-1.1, -0.9, 0.0]], requires_grad=True)
    trainer = _Trainer(args=_args(loss_type="dapo"), table=lp, accumulation=2)
    inputs = {**_inputs(), "num_items_in_batch": torch.tensor(20)}
    got = trainer._compute_loss(torch.nn.Linear(1, 1).train(), inputs)
    mean, _ = policy_loss(_batch(_inputs(), lp), clip_low=0.2, clip_high=0.28)  # Σ m·L / 5
    torch.testing.assert_close(got, mean * 5 / 10)


def test_delta_is_the_dual_clip_and_nan_vllm_logprobs_do_not_drop_tokens_without_a_correction(monkeypatch):
    lp = torch.tensor([[-0.9, -2.1, -0.4], [-1.1, -0.9, 0.0]], requires_grad=True)
    trainer = _Trainer(args=_args(delta=3.0), table=lp)
    assert trainer.offpolicy_loss_kwargs["objective"] == {"name": "ppo", "clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}
    inputs = _inputs()
    inputs["sampling_per_token_logps"] = torch.full((2, 3), float("nan"))  # TRL's "missing" vLLM log-probs
    # every valid μ non-finite: refused by default, naming the setting that lifts the limit
    with pytest.raises(ValueError, match="OFFPOLICY_MAX_NONFINITE_ROLLOUT"):
        trainer._compute_loss(torch.nn.Linear(1, 1).train(), dict(inputs))
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")  # the limit off: no token dropped without a correction
    got = trainer._compute_loss(torch.nn.Linear(1, 1).train(), inputs)
    want = trainer._compute_loss(torch.nn.Linear(1, 1).train(), _inputs())
    torch.testing.assert_close(got, want)


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
    # no vLLM: μ = π_old = π_θ, so the correction is the identity: nothing masked or capped
    assert all(h["offpolicy/tis/kept_frac"] == 1.0 and h["offpolicy/tis/capped_frac"] == 0.0 and h["offpolicy/loss/ratio_mean"] == 1.0 for h in logged)


@pytest.mark.slow
def test_matches_trls_own_loss_and_gradient_for_each_loss_type_with_accumulation(tmp_path):
    """OffPolicyGRPOTrainer._compute_loss == TRL's own GRPOTrainer._compute_loss (no correction), value and parameter
    gradient, on the same trainer and inputs: loss types bnpo / grpo / dr_grpo (max_completion_length > the padded
    width) / dapo / cispo (token and sequence level) / sapo, gradient accumulation, delta, clip-higher. TRL's loss is
    internal API: checked against TRL 1.16."""
    trl = pytest.importorskip("trl")
    if not trl.__version__.startswith("1.16"):
        pytest.skip(f"compares with TRL 1.16's internal _compute_loss; installed {trl.__version__}")
    datasets = pytest.importorskip("datasets")
    from trl import GRPOConfig, GRPOTrainer

    from offpolicy.integrations.trl import OffPolicyGRPOTrainer
    from offpolicy.models.tiny import build_tiny_model

    data = datasets.Dataset.from_list([{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)])

    def reward(completions, answer, **kwargs):
        return [float(len(c)) % 3 + float(c.strip().startswith(a)) for c, a in zip(completions, answer)]

    def make(loss_type, max_completion_length=8, **extra):
        torch.manual_seed(0)
        model, tok = build_tiny_model(seed=0)
        args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=max_completion_length, max_steps=1, report_to=[], use_cpu=True,
                          bf16=False, save_strategy="no", beta=0.0, loss_type=loss_type, **extra)
        trainer = OffPolicyGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                                       processing_class=tok)
        trainer.model.train()
        return trainer

    first = make("bnpo")
    torch.manual_seed(1)
    inputs = first._generate_and_score_completions([data[i] for i in range(2)] * 4)
    T = inputs["completion_mask"].shape[1]
    lengths = torch.tensor([8, 3, 5, 2, 7, 4, 6, 1]).clamp(max=T)  # unequal lengths: the aggregations differ
    inputs["completion_mask"] = (torch.arange(T)[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        current = first._get_per_token_logps_and_entropies(first.model, ids, attention, T)[0]
    inputs["old_per_token_logps"] = current + 0.3 * torch.randn(current.shape, generator=torch.Generator().manual_seed(3))
    inputs["num_items_in_batch"] = 4 * inputs["completion_mask"].sum()  # a generation batch of 4 micro-batches

    cases = [("bnpo", 4, 8, {}), ("grpo", 4, 8, {}), ("dr_grpo", 2, 16, {}), ("dapo", 4, 8, {"steps_per_generation": 4}),
             ("bnpo", 1, 8, {"delta": 1.5, "epsilon_high": 0.28}),
             # CISPO: TRL caps the weight at epsilon_high (1.3: binds on part of r = exp(0.3·N(0,1))); SAPO's gates
             ("cispo", 4, 8, {"steps_per_generation": 4, "epsilon_high": 1.3}),
             ("cispo", 2, 8, {"steps_per_generation": 4, "epsilon_high": 1.1, "importance_sampling_level": "sequence"}),
             ("sapo", 4, 8, {}), ("sapo", 1, 8, {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0})]
    for loss_type, accumulation, max_len, extra in cases:
        trainer = make(loss_type, max_len, **extra)
        trainer.current_gradient_accumulation_steps = accumulation
        theirs, g_theirs = loss_and_grad(trainer, functools.partial(GRPOTrainer._compute_loss, trainer), inputs)
        ours, g_ours = loss_and_grad(trainer, trainer._compute_loss, inputs)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7, msg=loss_type)
        assert ((g_ours - g_theirs).norm() / g_theirs.norm()).item() < 1e-5, (loss_type, accumulation, extra)
