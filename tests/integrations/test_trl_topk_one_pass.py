"""Top-k TRM and score centering in TRL score the update forward with one pass over the head
(offpolicy.integrations.trl.head_pass) instead of TRL's fused head plus a pass per statistic: on TRL's own batch the
loss, its gradient and TRL's metrics (``entropy`` …) equal vanilla ``GRPOTrainer._compute_loss``'s when the
correction keeps every token, the entropy bonus included; TRL's fused head runs in no update forward.

Against the stub vLLM server of ``conftest.py`` (offpolicy's HF engine in bfloat16), which returns the top-K."""

import functools

import pytest
import torch

from offpolicy.models.tiny import build_tiny_model

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
if not trl.__version__.startswith("1.16"):
    pytest.skip(f"compares with TRL 1.16's own loss; installed {trl.__version__}", allow_module_level=True)

from offpolicy_testkit.trl_toy import loss_and_grad, toy_dataset, varied_reward  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from offpolicy.integrations.trl import OffPolicyGRPOTrainer  # noqa: E402

KEEP_ALL = {"name": "trm", "max_kl": 1e9, "avg_kl": None}  # TRM that masks nothing: the loss is vanilla's


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                max_steps=2, report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", beta=0.0,
                seed=0, use_vllm=True, vllm_mode="server", vllm_importance_sampling_correction=False)
    return GRPOConfig(**{**base, **kw})


def _trainer(tmp_path, stub_vllm, stub_vllm_client, args_kw=None, **kw):
    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=0)
    stub_vllm["client"] = stub_vllm_client(model, tok)
    return OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=_args(tmp_path, **(args_kw or {})),
                                train_dataset=toy_dataset(), processing_class=tok, sync_check=None, **kw)


@pytest.mark.parametrize("extra", [
    {"loss_type": "bnpo"},
    {"loss_type": "dapo", "entropy_coef": 0.1, "temperature": 0.7},  # the bonus trains through the pass's entropy
    {"loss_type": "grpo", "top_entropy_quantile": 0.5},              # TRL's entropy mask reads it
])
def test_topk_loss_gradient_and_metrics_equal_trls(tmp_path, stub_vllm, stub_vllm_client, extra):
    trainer = _trainer(tmp_path, stub_vllm, stub_vllm_client, extra, topk_logprobs=4, correction=KEEP_ALL)
    trainer.model.train()
    torch.manual_seed(1)
    inputs = trainer._generate_and_score_completions([toy_dataset()[i] for i in range(2)] * 4)
    assert inputs["offpolicy_topk_logp"].shape[-1] == 4
    with torch.no_grad():  # π_old away from π_θ, so that the ratios move
        t = inputs["completion_ids"].shape[1]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        current = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, t)[0]
    trainer.current_gradient_accumulation_steps = 2
    inputs["num_items_in_batch"] = 4 * inputs["completion_mask"].sum()
    inputs["old_per_token_logps"] = current + 0.3 * torch.randn(current.shape,
                                                                generator=torch.Generator().manual_seed(3))
    theirs, g_theirs = loss_and_grad(trainer, functools.partial(GRPOTrainer._compute_loss, trainer), inputs)
    logged_theirs = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    ours, g_ours = loss_and_grad(trainer, trainer._compute_loss, inputs)
    logged_ours = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    assert ((g_ours - g_theirs).norm() / g_theirs.norm()).item() < 1e-5
    assert "entropy" in logged_theirs
    for key, value in logged_theirs.items():
        if key != "entropy_coef":  # logged at optimiser-step boundaries
            assert logged_ours[key] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), key
    assert logged_ours["offpolicy/topk/kl_upper_mean"] >= logged_ours["offpolicy/topk/kl_lower_mean"] >= 0


@pytest.mark.parametrize("kw", [{"correction": "trm"}, {"score_centering": True}])
def test_no_update_forward_runs_trls_fused_head(tmp_path, monkeypatch, stub_vllm, stub_vllm_client, kw):
    import trl.trainer.utils as trl_utils

    with_grad = []
    inner = trl_utils._ChunkedLogProbFunction.apply

    def counting(hidden, *args):
        with_grad.append(torch.is_grad_enabled())
        return inner(hidden, *args)

    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply", counting)
    trainer = _trainer(tmp_path, stub_vllm, stub_vllm_client, {"per_device_train_batch_size": 4,
                                                                "steps_per_generation": 2}, topk_logprobs=4, **kw)
    trainer.train()
    assert trainer.state.global_step == 2
    assert with_grad and not any(with_grad)  # π_old's scoring forward (TRL's head, no grad) only
