"""Sampling replay / DVP in TRL's ``train()`` recompute the lm_head themselves: TRL's fused head scores no position
(off CUDA it would score every one, ignored labels included, and its work would be thrown away)."""

import pytest
import torch

from offpolicy.models.tiny import build_tiny_model

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
if not trl.__version__.startswith("1.16"):
    pytest.skip(f"overrides TRL 1.16's internal methods; installed {trl.__version__}", allow_module_level=True)

from offpolicy_testkit.trl_toy import toy_dataset, varied_reward  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from offpolicy.integrations.trl import OffPolicyGRPOTrainer  # noqa: E402


@pytest.mark.parametrize("kw", [{"sampling_replay": True}, {"dvp_rho": 0.05}])
def test_replay_does_not_run_trls_fused_head(tmp_path, monkeypatch, kw):
    import trl.trainer.utils as trl_utils

    scored = []
    inner = trl_utils._ChunkedLogProbFunction.apply

    def counting(hidden, *args):
        scored.append(hidden.shape[0])
        return inner(hidden, *args)

    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply", counting)
    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=0)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=1, report_to=[], use_cpu=True, bf16=False, logging_steps=1,
                      save_strategy="no", beta=0.0, seed=0, temperature=0.7, top_k=20, num_iterations=2)
    trainer = OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(),
                                   processing_class=tok, **kw)
    trainer.train()
    assert trainer.state.global_step == 1
    assert scored == []  # π_old's forward (num_iterations = 2) and the update's: the replay's head only
