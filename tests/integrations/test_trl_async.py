"""``OffPolicyAsyncGRPOTrainer`` inside TRL 1.16's own ``AsyncGRPOTrainer`` on CPU (a tiny random Qwen2): TRL's
``train()`` through its ``rollout_worker=`` / ``weight_transfer=`` hooks with the test kit's stand-ins
(``offpolicy_testkit.async_trl``: a perturbed copy of the policy as the engine, the weights copied into it, the packed
tree attention in SDPA); each sample's version through TRL's queue and collator to a per-token staleness; the default
loss equal to TRL's own; a correction changing it by the hand-computed amount; another TRL version refused."""

import math
import queue
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest
import torch

from offpolicy.glossary import lookup
from offpolicy.models.tiny import build_tiny_model

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
if not trl.__version__.startswith("1.16"):
    pytest.skip(f"plugs into TRL 1.16's trl.experimental.async_grpo; installed {trl.__version__}",
                allow_module_level=True)

import datasets  # noqa: E402
from accelerate import PartialState  # noqa: E402
from offpolicy_testkit.async_trl import (  # noqa: E402
    CopyWeightTransfer,
    PerturbedRolloutWorker,
    cpu_constructor,
    cpu_tree_attention,
)
from offpolicy_testkit.trl_toy import logged  # noqa: E402
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # noqa: E402
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402

from offpolicy.integrations.trl import OffPolicyAsyncGRPOTrainer  # noqa: E402
from offpolicy.integrations.trl.async_grpo import (  # noqa: E402
    VERSION_KEY,
    VersionedCollator,
    VersionedRolloutQueueDataset,
    check_async_trl,
)

PROMPTS = [(f"{i}+{i}=", str(2 * i)) for i in range(8)]


def _reward(text, answer):
    return float(len(text)) % 3 + float(text.strip().startswith(answer))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, tok = build_tiny_model(seed=0)
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, model, tok


def _trainer(model_dir, tmp_path, *, noise_std=0.0, max_steps=3, cls=OffPolicyAsyncGRPOTrainer, **kw):
    folder, model, tok = model_dir
    worker = PerturbedRolloutWorker(model, tok, PROMPTS, _reward, num_generations=4, max_new_tokens=5,
                                    samples_per_version=8, noise_std=noise_std)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=5, max_steps=max_steps, report_to=[], use_cpu=True, bf16=False,
                           logging_steps=1, save_strategy="no", token_budget=0, learning_rate=1e-2, seed=0)
    with cpu_constructor():
        trainer = cls(model=str(folder), reward_funcs=lambda **k: [0.0], args=args, processing_class=tok,
                      train_dataset=datasets.Dataset.from_list([{"prompt": p} for p, _ in PROMPTS]),
                      rollout_worker=worker, weight_transfer=CopyWeightTransfer(worker), **kw)
    trainer.current_gradient_accumulation_steps = 1  # set by train(); the direct compute_loss calls need it
    return trainer, worker


def _sample(prompt_ids, completion, logps, advantage, version, group=0):
    return RolloutSample(prompt=[], completion=[], input_ids=np.array(prompt_ids + completion),
                         completion_mask=np.array([0] * len(prompt_ids) + [1] * len(completion)),
                         old_log_probs=np.array([0.0] * len(prompt_ids) + logps, dtype=np.float32),
                         advantage=advantage, model_version=version, group_id=group, metrics={})


def _item(sample):
    return {"input_ids": sample.input_ids, "completion_mask": sample.completion_mask,
            "old_log_probs": sample.old_log_probs, "advantage": sample.advantage, "group_id": sample.group_id,
            "metrics": sample.metrics, "model_version": sample.model_version}


def _inputs(samples):
    row = TreeRow()
    for s in samples:
        row.add(_item(s))
    return VersionedCollator(pad_token_id=0, num_processes=1).torch_call([[row]])


# -- the version gate --------------------------------------------------------------------------------------------
def test_a_trl_other_than_1_16_is_refused_naming_the_version():
    check_async_trl("1.16.0")  # the tested one passes
    for version in ("1.18.0", "1.15.2", "1.17.0rc1"):
        with pytest.raises(RuntimeError, match=f"TRL {version} is installed") as err:
            check_async_trl(version)
        assert "\n" not in str(err.value) and str(err.value).startswith("trl:")


def test_importing_the_trainer_under_another_trl_is_refused_in_one_line():
    code = ("import offpolicy.integrations.versions as v; v.installed_version = lambda package: '1.18.0'\n"
            "from offpolicy.integrations.trl import OffPolicyAsyncGRPOTrainer")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        "RuntimeError: trl: OffPolicyAsyncGRPOTrainer plugs into TRL 1.16's trl.experimental.async_grpo, but TRL "
        "1.18.0 is installed (later releases move the async trainer); install trl 1.16")
    assert "TRLExperimentalWarning" not in out.stderr  # refused before TRL's async module is imported


# -- the samples' versions ---------------------------------------------------------------------------------------
def test_trls_queue_dataset_carries_each_samples_version_and_still_drops_stale_ones():
    q = queue.Queue()
    for version in (4, 1, 0, 3):  # version 0 is 4 versions old at the trainer's 4: beyond max_staleness = 3, dropped
        q.put(_sample([1, 2], [3], [-0.5], 1.0, version))
    PartialState()  # TRL's dataset logs through accelerate's logger (the trainer creates this state)
    sink = defaultdict(list)
    ds = VersionedRolloutQueueDataset(rollout_queue=q, model_version_fn=lambda: 4, check_health_fn=None,
                                      stale_after_s=1.0, metrics=sink, max_staleness=3)
    it = iter(ds)
    assert [next(it)["model_version"] for _ in range(3)] == [4, 1, 3]
    assert sink["sample/dropped_stale_total"] == [1.0]


def test_a_sample_of_known_staleness_gives_that_staleness_on_each_of_its_completion_tokens(model_dir, tmp_path):
    trainer, _ = _trainer(model_dir, tmp_path)
    trainer.model_version = 5
    # three samples sharing a prompt (the trie packs it once): versions 5, 2, 4 → staleness 0, 3, 1
    samples = [_sample([1, 7, 8], [10, 11, 12], [-1.0, -2.0, -1.5], 1.0, 5),
               _sample([1, 7, 8], [13, 14], [-0.5, -0.7], -1.0, 2),
               _sample([1, 7, 8], [10, 15, 16, 17], [-1.0, -0.1, -0.2, -0.3], 0.5, 4)]
    inputs = _inputs(samples)
    assert inputs[VERSION_KEY].tolist() == [[5, 2, 4]]
    log_probs = torch.zeros(int((inputs["token_index"] >= 0).sum()))
    batch, stale = trainer.offpolicy_batch(inputs, log_probs)
    assert stale.tolist() == [[0, 0, 0, -1], [3, 3, -1, -1], [1, 1, 1, 1]]  # −1: past each completion's end
    assert batch.versions.tolist() == [[5, 5, 5, -1], [2, 2, -1, -1], [4, 4, 4, 4]]
    assert batch.policy_version == 5
    assert batch.rollout_logp[2].tolist() == pytest.approx([-1.0, -0.1, -0.2, -0.3])  # μ in completion order
    assert batch.advantages[1, :2].tolist() == [-1.0, -1.0]


# -- the loss ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def perturbed_inputs(model_dir, tmp_path_factory):
    """A packed micro-batch from the perturbed engine (noise 1.0 on its logits: μ far from π_θ), versions 3 and 2."""
    trainer, worker = _trainer(model_dir, tmp_path_factory.mktemp("inputs"), noise_std=1.0)
    worker.model_version = 3
    samples = worker._sample_group()
    for s in samples[2:]:
        s.model_version = 2
    return _inputs(samples)


def _loss_and_grad(trainer, inputs, fn):
    trainer.model.zero_grad()
    with cpu_tree_attention():
        loss = fn(trainer, trainer.model, inputs)
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]


def test_without_correction_or_objective_the_loss_and_gradient_are_trls_own(model_dir, tmp_path, perturbed_inputs):
    trainer, _ = _trainer(model_dir, tmp_path)
    trainer.model_version = 3
    ours, g_ours = _loss_and_grad(trainer, perturbed_inputs, OffPolicyAsyncGRPOTrainer.compute_loss)
    theirs, g_theirs = _loss_and_grad(trainer, perturbed_inputs, AsyncGRPOTrainer.compute_loss)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-7)
    assert len(g_ours) == len(g_theirs) > 0
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(g_ours, g_theirs))
    assert trainer._metrics["train"]["offpolicy/staleness/max"][-1] == 1.0


def test_tis_changes_the_loss_by_the_hand_computed_weights(model_dir, tmp_path, perturbed_inputs):
    upper = 1.5
    trainer, _ = _trainer(model_dir, tmp_path, correction={"name": "tis", "upper": upper})
    assert trainer.offpolicy_loss_kwargs["objective"]["name"] == "ppo"  # the correction carries π_θ/μ
    trainer.model_version = 3
    loss, _ = _loss_and_grad(trainer, perturbed_inputs, OffPolicyAsyncGRPOTrainer.compute_loss)
    with torch.no_grad(), cpu_tree_attention():
        lp, _, _ = trainer._packed_forward(trainer.model, perturbed_inputs)
    sel = perturbed_inputs["token_index"] >= 0
    mu, adv = perturbed_inputs["old_log_probs"][sel], perturbed_inputs["advantages"][sel]
    rho = torch.exp(lp - mu)
    assert bool((rho > upper).any()) and bool((rho < upper).any())  # the cap binds on some tokens only
    # r = 1 (π_old = sg π_θ), w = min(ρ, C): L = −Σ w·A / M (TRL's normaliser, one rank)
    expected = -(torch.clamp(rho, max=upper) * adv).sum() / sel.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    plain, _ = _trainer(model_dir, tmp_path / "plain")
    plain.model_version = 3
    none, _ = _loss_and_grad(plain, perturbed_inputs, OffPolicyAsyncGRPOTrainer.compute_loss)
    assert abs(loss.item() - none.item()) > 1e-3


def test_bypass_with_a_correction_and_a_bad_aggregation_are_refused(model_dir, tmp_path):
    with pytest.raises(ValueError, match="objective='bypass'"):
        _trainer(model_dir, tmp_path, correction="tis", objective="bypass")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        _trainer(model_dir, tmp_path, aggregation="mean_of_everything")


# -- TRL's own train() -------------------------------------------------------------------------------------------
def test_trls_train_with_tis_logs_finite_staleness_metrics_per_bucket(model_dir, tmp_path):
    # the engine is an exact copy of the synced weights (noise 0): fresh tokens (d = 0) have π_θ = μ up to the
    # packed-vs-plain forward's float error, stale ones (the trainer moved since) do not
    trainer, worker = _trainer(model_dir, tmp_path, correction={"name": "tis", "upper": 2.0})
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with cpu_tree_attention():
        trainer.train()
    assert trainer.weight_transfer.pushes == 4  # the cold sync + one per step
    assert worker.versions_served[:16] == [1] * 16  # the start() fill and the cold sync's, both at version 1
    assert logged(trainer, "offpolicy/staleness/max") == [0.0, 1.0, 2.0]
    assert logged(trainer, "offpolicy/staleness/mean") == [0.0, 1.0, 2.0]
    for d, step in ((0, 0), (1, 1), (2, 2)):
        rows = [h for h in trainer.state.log_history if "offpolicy/staleness/mean" in h]
        for name in ("k3_kl", "clipped_frac", "masked_frac", "tokens"):
            value = rows[step][f"offpolicy/staleness/d{d}/{name}"]
            assert math.isfinite(value), (d, name, value)
    k3 = {d: logged(trainer, f"offpolicy/staleness/d{d}/k3_kl")[0] for d in (0, 1, 2)}
    assert k3[0] < 1e-6 < k3[1]  # exact engine at d = 0; the policy moved by d = 1
    assert all(math.isfinite(v) for v in logged(trainer, "offpolicy/tis/weight_mean"))
    assert all(math.isfinite(v) for v in logged(trainer, "sampling/k3_kl"))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    ours = {k for h in trainer.state.log_history for k in h if k.startswith(("offpolicy/", "sampling/"))}
    assert len(ours) > 30 and [k for k in sorted(ours) if lookup(k) is None] == []  # each key in docs/metrics.md


def test_loglinear_proximal_reads_each_tokens_staleness(model_dir, tmp_path, perturbed_inputs):
    # AReaL's π_prox = μ + α(sg π_θ − μ), α = (d − 1)/d: at d ≤ 1 it is μ, so decoupled PPO + TIS is TRL's loss
    # (r = π_θ/μ clipped, weight π_prox/μ = 1); three versions later (d = 3, 4) π_prox moves towards π_θ
    loglinear = {"name": "decoupled", "proximal": "loglinear"}
    trainer, _ = _trainer(model_dir, tmp_path, correction={"name": "tis", "upper": 2.0}, objective=loglinear)
    trainer.model_version = 3
    fresh, _ = _loss_and_grad(trainer, perturbed_inputs, OffPolicyAsyncGRPOTrainer.compute_loss)
    assert trainer._metrics["train"]["offpolicy/tis/weight_mean"][-1] == pytest.approx(1.0)
    theirs, _ = _loss_and_grad(trainer, perturbed_inputs, AsyncGRPOTrainer.compute_loss)
    assert fresh.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-7)
    trainer.model_version = 6
    stale, _ = _loss_and_grad(trainer, perturbed_inputs, OffPolicyAsyncGRPOTrainer.compute_loss)
    assert trainer._metrics["train"]["offpolicy/staleness/mean"][-1] > 3.0
    assert abs(stale.item() - fresh.item()) > 1e-4
    assert trainer._metrics["train"]["offpolicy/tis/weight_mean"][-1] != pytest.approx(1.0)


# -- the weight transfer without NCCL ----------------------------------------------------------------------------
def test_file_weight_transfer_writes_the_tied_head_and_asks_the_server_to_reload(model_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from offpolicy.integrations.trl import FileWeightTransfer, async_sync

    calls = []
    monkeypatch.setattr(async_sync, "vllm_reload_weights", lambda url, path, **kw: calls.append((url, path, kw)))
    with pytest.raises(ValueError, match="url must be the server's http"):
        FileWeightTransfer("localhost:8000")
    _, model, _ = model_dir
    transfer = FileWeightTransfer("http://127.0.0.1:9/", tmp_path / "reload", timeout=7)
    transfer.bind(model)
    assert transfer.aliases == {"model.embed_tokens.weight": ["lm_head.weight"]}
    transfer.init_weight_transfer()
    transfer.pause()
    transfer.send_weights(iter(model.named_parameters()))  # what TRL streams: the tied head once
    transfer.resume()
    assert transfer.pushes == 1
    assert calls == [("http://127.0.0.1:9", str(tmp_path / "reload"),
                      {"weights_path": str(tmp_path / "reload"), "timeout": 7.0})]
    written = {}
    for shard in (tmp_path / "reload").glob("*.safetensors"):
        written.update(load_file(shard))
    assert torch.equal(written["lm_head.weight"], model.model.embed_tokens.weight)
    assert set(written) == {n for n, _ in model.named_parameters(remove_duplicate=False)}
