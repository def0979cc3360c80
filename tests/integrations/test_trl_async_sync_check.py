"""The sync check of ``OffPolicyAsyncGRPOTrainer`` inside TRL 1.16's own ``train()`` on CPU (a tiny random Qwen2, the
test kit's stand-in worker and weight copy): an intact transfer passes at every sync; a transfer that drops one tensor
is named by the parameter layer, one that writes a wrong tensor by the probe's gap, one after which the worker reports
another version by the version check — each a one-line error naming the step; ``warn`` logs and trains on; ``off``
runs no check; a worker that cannot be scored is refused at construction."""

import logging
import math

import pytest

from offpolicy.models.tiny import build_tiny_model

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
if not trl.__version__.startswith("1.16"):
    pytest.skip(f"plugs into TRL 1.16's trl.experimental.async_grpo; installed {trl.__version__}",
                allow_module_level=True)

import datasets  # noqa: E402
from offpolicy_testkit.async_trl import (  # noqa: E402
    CopyWeightTransfer,
    PerturbedRolloutWorker,
    TamperedTransfer,
    cpu_constructor,
    cpu_tree_attention,
)
from offpolicy_testkit.trl_toy import logged  # noqa: E402
from trl.experimental.async_grpo import AsyncGRPOConfig  # noqa: E402

from offpolicy.glossary import lookup  # noqa: E402
from offpolicy.integrations.trl import OffPolicyAsyncGRPOTrainer  # noqa: E402
from offpolicy.rollout.sync_check import SyncCheckError  # noqa: E402

PROMPTS = [(f"{i}+{i}=", str(2 * i)) for i in range(8)]
LAYER = "model.layers.1.mlp.down_proj.weight"  # a tensor the stream carries (not tied, not the head)


def _reward(text, answer):
    return float(len(text)) % 3 + float(text.strip().startswith(answer))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, tok = build_tiny_model(seed=0)
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, model, tok


def _trainer(model_dir, tmp_path, *, transfer=None, worker_cls=PerturbedRolloutWorker, max_steps=3, lr=1e-2, **kw):
    folder, model, tok = model_dir
    worker = worker_cls(model, tok, PROMPTS, _reward, num_generations=4, max_new_tokens=5, samples_per_version=8)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=5, max_steps=max_steps, report_to=[], use_cpu=True, bf16=False,
                           logging_steps=1, save_strategy="no", token_budget=0, learning_rate=lr, seed=0)
    copy = CopyWeightTransfer(worker)
    with cpu_constructor():
        trainer = OffPolicyAsyncGRPOTrainer(
            model=str(folder), reward_funcs=lambda **k: [0.0], args=args, processing_class=tok,
            train_dataset=datasets.Dataset.from_list([{"prompt": p} for p, _ in PROMPTS]), rollout_worker=worker,
            weight_transfer=copy if transfer is None else transfer(copy), **kw)
    return trainer, worker


def _train(trainer):
    with cpu_tree_attention():
        trainer.train()


def test_an_intact_transfer_passes_every_sync_with_both_layers(model_dir, tmp_path):
    trainer, worker = _trainer(model_dir, tmp_path, correction="tis")
    _train(trainer)
    ok = logged(trainer, "sync/ok")
    # the cold transfer is logged with step 1's metrics (TRL averages a key over its logging window)
    assert len(ok) == 3 and all(v == 1.0 for v in ok)
    assert trainer.offpolicy_sync.transfers == 4 and worker.model_version == 4
    assert all(v < 1e-5 for v in logged(trainer, "sync/gap"))  # fp32 copy of the weights: round-off only
    assert all(v > 0 for v in logged(trainer, "sync/params_checked"))  # the stand-in's tensors are readable
    assert all(v == 0.0 for v in logged(trainer, "sync/params_left"))
    keys = {k for h in trainer.state.log_history for k in h if k.startswith("sync/")}
    assert {"sync/gap", "sync/baseline", "sync/seconds", "sync/push_seconds"} <= keys
    assert [k for k in sorted(keys) if lookup(k) is None] == []  # each documented in docs/metrics.md


def test_a_transfer_that_drops_a_tensor_is_caught_naming_the_step_and_the_tensor(model_dir, tmp_path):
    # at lr 1e-7 the lag one tensor leaves is far below the probe's resolution: the parameter layer names it
    broken = []

    def drop(inner):  # push 2: the first after an optimizer step (push 1 is the cold one: nothing moved yet)
        broken.append(TamperedTransfer(inner, at_push=2, drop=LAYER))
        return broken[-1]

    trainer, _ = _trainer(model_dir, tmp_path, transfer=drop, lr=1e-7)
    with pytest.raises(SyncCheckError) as err:
        _train(trainer)
    message = str(err.value)
    assert broken[0].tampered == [LAYER]
    assert message.startswith("weight transfer 2 at step 1 (model version 2): 1 of the engine's tensors did not "
                              f"change while the trainer's did ({LAYER})")
    assert "\n" not in message
    # at lr 1e-2 the same drop moves the probe past the gap's threshold: caught first by the gap, naming the metric
    trainer, _ = _trainer(model_dir, tmp_path, transfer=lambda t: TamperedTransfer(t, at_push=2, drop=LAYER))
    with pytest.raises(SyncCheckError, match=r"^weight transfer 2 at step 1 \(model version 2\): after the weight "
                                             r"sync the engine's log-probs are \S+ nats per token"):
        _train(trainer)


def test_a_transfer_that_writes_a_wrong_tensor_is_caught_by_the_probes_gap(model_dir, tmp_path):
    trainer, _ = _trainer(model_dir, tmp_path, transfer=lambda t: TamperedTransfer(t, at_push=3, corrupt=LAYER))
    with pytest.raises(SyncCheckError) as err:
        _train(trainer)
    message = str(err.value)
    assert message.startswith("weight transfer 3 at step 2 (model version 3): after the weight sync the engine's "
                              "log-probs are ")
    assert "nats per token from the trainer's" in message and "\n" not in message


def test_warn_logs_the_broken_transfer_and_trains_on(model_dir, tmp_path, caplog):
    trainer, worker = _trainer(model_dir, tmp_path, sync_check="warn",
                               transfer=lambda t: TamperedTransfer(t, at_push=3, drop=LAYER))
    with caplog.at_level(logging.WARNING, logger="offpolicy.rollout.sync_check"):
        _train(trainer)
    assert trainer.state.global_step == 3 and worker.model_version == 4  # trained to the end
    assert logged(trainer, "sync/ok") == [1.0, 0.0, 1.0]  # step 2's transfer (the third) failed
    assert "weight transfer 3 at step 2 (model version 3): after the weight sync the engine's" in caplog.text
    assert all(math.isfinite(v) for v in logged(trainer, "offpolicy/loss/policy"))


class _DeafWorker(PerturbedRolloutWorker):
    """Takes the weights but not the version: stays at the first one it was told."""

    def update_model_version(self, model_version):
        if self.model_version == 0:
            super().update_model_version(model_version)
        else:
            self._fill()


def test_a_worker_that_reports_another_version_is_caught(model_dir, tmp_path):
    trainer, _ = _trainer(model_dir, tmp_path, worker_cls=_DeafWorker)
    with pytest.raises(SyncCheckError, match=r"^weight transfer 2 at step 1 \(model version 2\): the rollout worker "
                                             r"reports model version 1 after the transfer of version 2"):
        _train(trainer)


def test_off_runs_no_check_and_a_bad_value_is_refused(model_dir, tmp_path):
    trainer, _ = _trainer(model_dir, tmp_path, sync_check="off", max_steps=1,
                          transfer=lambda t: TamperedTransfer(t, at_push=2, drop=LAYER))
    assert trainer.offpolicy_sync is None
    _train(trainer)
    assert not any(k.startswith("sync/") for h in trainer.state.log_history for k in h)
    with pytest.raises(ValueError, match="sync_check must be one of"):
        _trainer(model_dir, tmp_path, sync_check="raise")


class _Unscored(PerturbedRolloutWorker):
    score = None  # a custom worker without score(): nothing to check against


def test_a_worker_that_cannot_be_scored_is_refused_naming_sync_check(model_dir, tmp_path):
    with pytest.raises(ValueError, match="^sync_check: the rollout worker _Unscored cannot score given tokens"):
        _trainer(model_dir, tmp_path, worker_cls=_Unscored)
    trainer, _ = _trainer(model_dir, tmp_path, worker_cls=_Unscored, sync_check=None)  # unchecked is allowed
    assert trainer.offpolicy_sync is None
