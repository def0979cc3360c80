"""The verl adapter inside verl's real actor path, on CPU: loss, metrics and gradient equal verl's own ``vanilla``.

What runs is what a verl job runs on each worker since verl 0.8 (``DataParallelPPOActor`` is gone): a
``TrainingWorker`` with the FSDP2 engine, ``ppo_loss`` bound to an actor config (which looks the policy loss up in
verl's registry by ``policy_loss.loss_mode``) and ``train_mini_batch`` splitting the mini-batch into micro-batches —
here in one process with a gloo group and a tiny random Qwen2 saved to a temporary folder.

verl assumes an accelerator; nothing in verl is changed: offpolicy_testkit/verl_cpu.py supplies what a CPU run lacks
(a ``cpu`` platform, the FSDP engine registered for it, eager attention, fp32, verl's TRL check off, ``temperature``
in the batch's ``meta_info``).

Skipped only when verl is not installed; ``.ci/run`` installs the pinned ``verl==0.9.1`` (``--no-deps``) and the
packages its actor path imports (the ``verl-ci`` extra).
"""

from __future__ import annotations

import contextlib
import importlib.metadata

import pytest
import torch

verl = pytest.importorskip("verl")

from offpolicy_testkit.verl_cpu import (
    ActorBatch,
    cpu_platform,
    make_worker,
    process_group,
    setup_cpu_verl,
    tiny_qwen2,
)

from offpolicy.corrections.importance import mis, tis
from offpolicy.corrections.vocabulary import constrained_logp, replay_support_logp
from offpolicy.integrations.verl import register_verl_policy_loss, rollout_correction

# the harness is offpolicy_testkit/verl_cpu.py; its default batch, under the names the tests below use
SHAPE = ActorBatch()
B, P, R, VOCAB, MICRO = SHAPE.b, SHAPE.p, SHAPE.r, SHAPE.vocab, SHAPE.micro  # two micro-batches per mini-batch
ADVANTAGES, LENGTHS = SHAPE.advantages, SHAPE.lengths  # row 1 also has left padding in its prompt
_inputs, _batch, infer_logp, _train = SHAPE.inputs, SHAPE.batch, SHAPE.infer_logp, SHAPE.train
_reference_logits = SHAPE.reference_logits
_cpu_platform = cpu_platform
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """One gloo group for the module and the tiny model's folder."""
    setup_cpu_verl()
    with process_group():
        yield tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def worker(model_path):
    """verl's own engine, lr 0 so every call sees the same weights; the adapter registered under two names."""
    w = make_worker(model_path)
    for name, version in (("offpolicy_test", None), ("offpolicy_test_070", "0.7.0")):
        register_verl_policy_loss(name, verl_version=version)
    return w


@pytest.fixture(scope="module")
def current_logp(worker):
    """π_θ's log-probs of the responses [B, R] from the worker's own forward (0 at padding)."""
    return infer_logp(worker)


def _old_logp(current: torch.Tensor, dual_clip_binds: bool) -> torch.Tensor:
    """π_old: within ±0.3 of π_θ (PPO's clip binds on some tokens); with ``dual_clip_binds`` every other token of the
    A < 0 rows has r = π_θ/π_old = e² ≈ 7.4 > clip_ratio_c = 3."""
    noise = 0.3 * torch.randn(B, R, generator=torch.Generator().manual_seed(3))
    old = current + noise.clamp(-0.3, 0.3)
    if dual_clip_binds:
        old[ADVANTAGES < 0, ::2] = current[ADVANTAGES < 0, ::2] - 2.0
    return old


def test_installed_verl_is_the_pinned_release():
    # what the README says was run; bump both together
    assert importlib.metadata.version("verl") == "0.9.1"


@pytest.mark.parametrize("dual_clip_binds", [False, True], ids=["no-dual-clip", "dual-clip-binds"])
@pytest.mark.parametrize("agg", MODES)
def test_adapter_equals_verl_vanilla_in_the_actor(worker, current_logp, agg, dual_clip_binds):
    tensors = {"old_log_probs": _old_logp(current_logp, dual_clip_binds),
               "advantages": ADVANTAGES[:, None].expand(B, R).contiguous()}
    verl_metrics, verl_grad = _train(worker, "vanilla", agg, tensors)
    ours_metrics, ours_grad = _train(worker, "offpolicy_test", agg, tensors)

    assert verl_grad.abs().max() > 1e-3  # a real gradient, not two zeros
    torch.testing.assert_close(ours_grad, verl_grad, rtol=1e-5, atol=1e-7)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "grad_norm"):
        assert ours_metrics[key] == pytest.approx(verl_metrics[key], rel=1e-5, abs=1e-7), key
    assert max(verl_metrics["actor/pg_clipfrac"]) > 0  # PPO's clip binds on some tokens in both cases
    assert (max(verl_metrics["actor/pg_clipfrac_lower"]) > 0) == dual_clip_binds


def test_pre_0_7_1_rule_is_global_batch_size_times_too_large_in_verl_0_9(worker, current_logp):
    # The rule of verl ≤ 0.7.0 (Σ / T, no sequence count) against verl 0.9.1's (Σ / (G·T) · dp): the gradient differs by
    # exactly G / dp = 8 — what the adapter did before it read the installed version.
    tensors = {"old_log_probs": _old_logp(current_logp, False),
               "advantages": ADVANTAGES[:, None].expand(B, R).contiguous()}
    _, verl_grad = _train(worker, "vanilla", "seq-mean-token-sum-norm", tensors)
    _, old_rule_grad = _train(worker, "offpolicy_test_070", "seq-mean-token-sum-norm", tensors)
    torch.testing.assert_close(old_rule_grad, B * verl_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "verl_config, correction",
    [
        # verl algorithm.rollout_correction.* → the offpolicy correction the name table in corrections/importance.py gives
        ({"rollout_is": "token", "rollout_is_threshold": 2.0}, tis(upper=2.0)),
        ({"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True},
         tis(upper=2.0, level="sequence", normalize=True)),
        # token IS at 2 plus token_k1 rejection outside ρ ∈ [0.5, 2]: the kept tokens' ρ ≤ 2 is never truncated, so
        # this is MIS on [0.5, 2] (verl's k1 = −log ρ, so its "L_U" keeps ρ ∈ [1/U, 1/L]; symmetric here)
        ({"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1",
          "rollout_rs_threshold": "0.5_2.0"}, mis(lower=0.5, upper=2.0)),
    ],
    ids=["token-tis", "sequence-tis-normalized", "token-is-with-k1-rejection"],
)
def test_rollout_correction_composes_with_verls(worker, current_logp, verl_config, correction):
    """verl's ``compute_rollout_correction_and_add_to_batch`` then its ``vanilla`` loss, against
    :func:`rollout_correction` then the adapter, ``keep`` applied to ``response_mask`` as verl applies its rejection."""
    from verl import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.rollout_corr_helper import (
        compute_rollout_correction_and_add_to_batch,
    )

    old = current_logp  # the π_old forward at the start of the step
    # μ: a sizeable mismatch (a tenth of it at sequence level, where the product ratio over 6 tokens is the weight)
    scale = 0.15 if verl_config["rollout_is"] == "sequence" else 1.2
    rollout = old + scale * torch.randn(B, R, generator=torch.Generator().manual_seed(5))
    mask = _inputs()[1][:, P:]
    advantages = ADVANTAGES[:, None].expand(B, R).contiguous()

    verl_batch = DataProto.from_single_dict({"old_log_probs": old, "rollout_log_probs": rollout,
                                             "response_mask": mask.clone()})
    verl_batch, _ = compute_rollout_correction_and_add_to_batch(verl_batch, RolloutCorrectionConfig(**verl_config))
    verl_mask = verl_batch.batch["response_mask"]
    verl_weights = verl_batch.batch["rollout_is_weights"]

    weights, keep, metrics = rollout_correction(old, rollout, mask, correction)
    ours_mask = mask * keep
    assert torch.equal(ours_mask.bool(), verl_mask.bool())
    torch.testing.assert_close(weights * ours_mask, verl_weights * verl_mask, rtol=1e-6, atol=1e-7)
    assert ((weights - 1.0).abs() * ours_mask).max() > 0.1  # the weights are not all 1
    if "rollout_rs" in verl_config:
        assert 0 < ours_mask.sum() < mask.sum()  # the rejection drops some tokens, not all
    assert metrics and all(k.startswith("rollout_corr/") for k in metrics)

    verl_metrics, verl_grad = _train(worker, "vanilla", "token-mean", {
        "old_log_probs": old, "advantages": advantages, "rollout_is_weights": verl_weights,
        "response_mask": verl_mask})
    ours_metrics, ours_grad = _train(worker, "offpolicy_test", "token-mean", {
        "old_log_probs": old, "advantages": advantages, "rollout_is_weights": weights, "response_mask": ours_mask})
    torch.testing.assert_close(ours_grad, verl_grad, rtol=1e-5, atol=1e-7)
    assert ours_metrics["actor/pg_loss"] == pytest.approx(verl_metrics["actor/pg_loss"], rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Several mini-batches: every metric equals vanilla's in every loss_agg_mode (the weights move between mini-batches)
# ---------------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _learning(worker, lr: float):
    """The worker trains at ``lr`` inside; its weights, optimiser state and lr are restored on exit."""
    import copy

    engine = worker.engine
    params = [p.detach().clone() for p in engine.module.parameters()]
    state = copy.deepcopy(engine.optimizer.state_dict())
    before = [g["lr"] for g in engine.optimizer.param_groups]
    base_lrs = list(engine.lr_scheduler.base_lrs)
    engine.lr_scheduler.base_lrs = [lr for _ in base_lrs]
    for g in engine.optimizer.param_groups:
        g["lr"] = lr

    def restore():
        with torch.no_grad():
            for p, q in zip(engine.module.parameters(), params):
                p.copy_(q)
        engine.optimizer.load_state_dict(state)
        engine.lr_scheduler.base_lrs = [lr for _ in base_lrs]
        for g in engine.optimizer.param_groups:
            g["lr"] = lr

    try:
        yield restore
    finally:
        restore()
        engine.lr_scheduler.base_lrs = base_lrs
        for g, value in zip(engine.optimizer.param_groups, before):
            g["lr"] = value


@pytest.mark.parametrize("agg", MODES)
def test_every_metric_equals_vanillas_over_several_mini_batches(worker, current_logp, agg):
    """Two mini-batches of 4 (two optimiser steps at lr 1e-2, so the second mini-batch sees moved weights), two
    epochs: per mini-batch, every metric verl's vanilla reports is the adapter's too (the issue's token-sum case:
    pg_clipfrac and ppo_kl from the second mini-batch on)."""
    tensors = {"old_log_probs": _old_logp(current_logp, True),
               "advantages": ADVANTAGES[:, None].expand(B, R).contiguous()}
    with _learning(worker, 1e-2) as restore:
        verl_metrics, verl_grads = _train(worker, "vanilla", agg, tensors, mini=4, epochs=2)
        restore()
        ours_metrics, ours_grads = _train(worker, "offpolicy_test", agg, tensors, mini=4, epochs=2)
    assert len(verl_grads) == 4  # 2 mini-batches × 2 epochs
    for ours, theirs in zip(ours_grads, verl_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
    compared = [k for k in verl_metrics if k.startswith("actor/") or k in ("loss", "grad_norm")]
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/pg_loss"} <= set(compared)
    for key in compared:
        assert ours_metrics[key] == pytest.approx(verl_metrics[key], rel=1e-4, abs=1e-6), key
    kl = verl_metrics["actor/ppo_kl"]
    assert len(kl) == 4 and abs(kl[1] - kl[0]) > 1e-3  # the later mini-batches see moved weights


def test_metrics_equal_vanillas_when_the_policy_moves_beyond_e20(worker, current_logp):
    """token-sum, two mini-batches, a dual clip that binds (clip_ratio_c 1.1) and a step large enough (lr 1) that the
    second mini-batch sees tokens with |log π_θ − log π_old| > 20. verl's vanilla clamps log r to ±20 before its
    ``ppo_kl`` and counts in ``pg_clipfrac`` only the tokens PPO's clip changes for their advantage's sign; the
    adapter once reported the unclamped mean and offpolicy's "held" tokens (a token beyond e^±20 counted whatever
    its advantage), so from the second mini-batch on it read e.g. ppo_kl 11.2 against verl's 8.8 and pg_clipfrac
    0.56 against 0.28 while the loss and the gradient agreed."""
    tensors = {"old_log_probs": _old_logp(current_logp, True),
               "advantages": ADVANTAGES[:, None].expand(B, R).contiguous()}
    seen: list = []
    with _learning(worker, 1.0) as restore:
        worker.engine.optimizer.state.clear()  # a fresh Adam: the step's size does not depend on earlier tests
        verl_metrics, verl_grads = _train(worker, "vanilla", "token-sum", tensors, mini=4, seen=seen,
                                          clip_ratio_c=1.1)
        restore()
        worker.engine.optimizer.state.clear()
        ours_metrics, ours_grads = _train(worker, "offpolicy_test", "token-sum", tensors, mini=4, clip_ratio_c=1.1)
    for ours, theirs in zip(ours_grads, verl_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert ours_metrics[key] == pytest.approx(verl_metrics[key], rel=1e-5, abs=1e-7), key
    assert verl_metrics["actor/pg_clipfrac_lower"][0] > 0  # the dual clip binds
    # the case the metrics diverged on: the second mini-batch (rows 4–7) has tokens beyond ±20, so the clamped and
    # the unclamped means differ there, and verl's ppo_kl is the clamped one
    old, mask = tensors["old_log_probs"][4:], _inputs()[1][4:, P:].bool()
    log_r = (seen[1] - old)[mask]
    assert log_r.abs().max() > 20
    unclamped, clamped = (-log_r).mean().item(), (-log_r.clamp(-20, 20)).mean().item()
    assert abs(unclamped - clamped) > 0.5
    assert verl_metrics["actor/ppo_kl"][1] == pytest.approx(clamped, rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# The plug-in's engine: the sampling recipe in both forwards, ALP in the update forward only
# ---------------------------------------------------------------------------------------------------------------

TEMPERATURE = 0.7


RECIPES = {
    # DVP: min-p only → the trainer's constrained log-prob over its own safe set (constrained_logp)
    "dvp": ({"min_p": 0.6}, lambda z, y: constrained_logp(z, y, rho=0.6).logp),
    # sampling replay: vLLM's min-p → top-k → top-p on z / T (replay_support_logp)
    "replay": ({"min_p": 0.3, "top_k": 8, "top_p": 0.9},
               lambda z, y: replay_support_logp(z, y, min_p=0.3, top_k=8, top_p=0.9, order=("min_p", "top_k", "top_p"))[0]),
}


@pytest.fixture(scope="module", params=sorted(RECIPES))
def recipe_worker(request, model_path, worker):
    sampling, reference = RECIPES[request.param]
    return make_worker(model_path, {"sampling": sampling}), reference


def test_plugin_engine_scores_both_forwards_under_the_recipe(recipe_worker, worker):
    from offpolicy.integrations.verl.engine import OffPolicyFSDPEngine

    w, reference = recipe_worker
    assert type(w.engine) is OffPolicyFSDPEngine and type(worker.engine) is not OffPolicyFSDPEngine
    mask = _inputs()[1][:, P:].bool()
    responses = _inputs()[0][:, P:]
    expected = reference(_reference_logits(w) / TEMPERATURE, responses) * mask

    old = infer_logp(w, {"temperature": TEMPERATURE})  # the old-log-prob forward (eval, no grad)
    torch.testing.assert_close(old, expected, rtol=1e-5, atol=1e-5)
    plain = infer_logp(worker, {"temperature": TEMPERATURE})  # verl's own engine: log softmax(z / T)
    assert (old - plain).abs().max() > 0.1  # the recipe changes the log-probs

    seen: list[torch.Tensor] = []  # the update forward (train, grad on)
    tensors = {"old_log_probs": old, "advantages": ADVANTAGES[:, None].expand(B, R).contiguous()}
    _train(w, "vanilla", "token-mean", tensors, meta={"temperature": TEMPERATURE}, seen=seen)
    torch.testing.assert_close(torch.cat(seen) * mask, expected, rtol=1e-5, atol=1e-5)


def test_plugin_engine_gives_the_driver_the_recipes_support_in_the_old_log_prob_forward(recipe_worker):
    """verl's ``_compute_old_log_prob`` (no grad, entropy on): two more outputs laid out as its log_probs, whether each
    sampled token is inside π_old's support (DVP's safe set, replay's support) and the support's retained mass —
    what the driver's ``dvp_keep`` reads; the reference forward (no entropy) and the update forward add none."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from offpolicy.forward_scores import token_scores
    from offpolicy.integrations.verl.settings import DVP_KEEP_FIELD, DVP_MASS_FIELD

    w, _ = recipe_worker
    mask = _inputs()[1][:, P:].bool()
    responses = _inputs()[0][:, P:]
    data = _batch({}, {"compute_loss": False, "calculate_entropy": True, "temperature": TEMPERATURE})
    out = w.infer_batch(data)
    keep, mass = (no_padding_2_padding(tu.get(out, key), data).float() for key in (DVP_KEEP_FIELD, DVP_MASS_FIELD))
    z = _reference_logits(w)[mask]
    want = token_scores(responses[mask], logits=z / TEMPERATURE, recipe=w.engine.offpolicy.sampling.config)
    torch.testing.assert_close(keep[mask], want.inside.float())
    torch.testing.assert_close(mass[mask], want.mass, rtol=1e-5, atol=1e-6)
    assert bool((mass[mask] <= 1.0 + 1e-6).all()) and bool((mass[mask] > 0).all())
    assert 0 < int(keep[mask].sum()) < int(mask.sum())  # this recipe leaves some sampled tokens outside
    ref = w.infer_batch(_batch({}, {"compute_loss": False, "temperature": TEMPERATURE}))
    assert DVP_KEEP_FIELD not in ref.keys() and DVP_MASS_FIELD not in ref.keys()  # noqa: SIM118 - TensorDict keys
    keys: list = []
    tensors = {"old_log_probs": infer_logp(w, {"temperature": TEMPERATURE}),
               "advantages": ADVANTAGES[:, None].expand(B, R).contiguous()}
    _train(w, "vanilla", "token-mean", tensors, meta={"temperature": TEMPERATURE}, output_keys=keys)
    assert keys and all(DVP_KEEP_FIELD not in k for k in keys)


def test_plugin_engine_scores_the_recipe_under_verls_bf16_mixed_precision(model_path, worker):
    """verl's default precision (FSDP2 computing in bf16 over fp32 weights): the plug-in's engine scores DVP's
    recipe in both forwards without refusing the dtype; the result is the fp32 one up to bf16's rounding of the
    logits (well under the recipe's own effect), and an update step on it trains."""
    sampling, reference = RECIPES["dvp"]
    w = make_worker(model_path, {"sampling": sampling}, compute_dtype="bf16")
    mask, responses = _inputs()[1][:, P:].bool(), _inputs()[0][:, P:]
    expected = reference(_reference_logits(w) / TEMPERATURE, responses) * mask  # from the module's own bf16 forward
    old = infer_logp(w, {"temperature": TEMPERATURE})
    torch.testing.assert_close(old, expected, rtol=1e-5, atol=1e-5)
    fp32 = reference(_reference_logits(worker) / TEMPERATURE, responses) * mask  # the same weights computed in fp32
    diff = (old - fp32)[mask].abs()
    assert 0 < float(diff.max()) < 0.05, float(diff.max())  # bf16's rounding of the logits, not another model
    plain = infer_logp(worker, {"temperature": TEMPERATURE})
    assert float((old - plain).abs().max()) > 0.1  # the recipe still acts
    seen: list[torch.Tensor] = []
    tensors = {"old_log_probs": old, "advantages": ADVANTAGES[:, None].expand(B, R).contiguous()}
    _train(w, "vanilla", "token-mean", tensors, meta={"temperature": TEMPERATURE}, seen=seen)
    assert seen and bool(torch.isfinite(torch.cat(seen)).all())


ALP = {"init_std": 0.05, "lr": 0.1, "seed": 0}  # σ large enough to move fp32 log-probs visibly


@pytest.fixture(scope="module")
def alp_worker(model_path, worker):
    return make_worker(model_path, {"alp": ALP})


def test_plugin_alp_noise_only_in_the_update_forward(alp_worker, current_logp):
    w = alp_worker
    alp = w.engine.alp
    assert alp is not None and alp.num_layers == 2
    assert all(p is not alp.log_sigma for p in w.engine.module.parameters())  # outside the model
    assert not any("sigma" in k for k in w.engine.module.state_dict())  # no weight sync or HF checkpoint sees σ
    assert w.engine.optimizer.param_groups[-1]["params"] == [alp.log_sigma]
    assert w.engine.optimizer.param_groups[-1]["lr"] == pytest.approx(ALP["lr"])

    # old-log-prob forward: noise-free, equal to verl's own engine on the same weights
    torch.testing.assert_close(infer_logp(w), current_logp, rtol=1e-6, atol=1e-6)

    sigma_grads = []
    step = w.engine.optimizer_step

    def record_sigma_grad_then_step():
        sigma_grads.append(alp.log_sigma.grad.detach().clone())
        return step()

    w.engine.optimizer_step = record_sigma_grad_then_step
    before = alp.log_sigma.detach().clone()
    seen: list[torch.Tensor] = []
    tensors = {"old_log_probs": current_logp, "advantages": ADVANTAGES[:, None].expand(B, R).contiguous()}
    try:
        metrics, _ = _train(w, "vanilla", "token-mean", tensors, seen=seen)
    finally:
        w.engine.optimizer_step = step
    mask = _inputs()[1][:, P:].bool()
    noisy = torch.cat(seen)
    assert ((noisy - current_logp).abs() * mask).max() > 1e-3  # the update forward is perturbed
    assert not alp.is_enabled  # and the noise is off again afterwards
    torch.testing.assert_close(infer_logp(w), current_logp, rtol=1e-6, atol=1e-6)
    (grad,) = sigma_grads
    assert grad.abs().min() > 0  # every layer's σ gets a gradient
    assert not torch.equal(alp.log_sigma.detach(), before)  # and its own group steps it (the model's lr is 0)
    # σ after the step reaches verl's metrics (``actor/alp/…`` in its step log), one value per rank
    sigma = alp.log_sigma.detach().exp()
    assert metrics["alp/sigma_mean"] == [pytest.approx(float(sigma.mean()), rel=1e-6)]
    assert metrics["alp/sigma_min"] == [pytest.approx(float(sigma.min()), rel=1e-6)]
    assert [metrics[f"alp/sigma/{i}"] for i in alp.layer_indices] == [[pytest.approx(float(v), rel=1e-6)] for v in sigma]


def test_plugin_alp_sigma_round_trips_through_verls_checkpoint(alp_worker, tmp_path):
    from verl.trainer.config import CheckpointConfig

    from offpolicy.perturbation import ALP_CHECKPOINT_FILE

    w = alp_worker
    alp = w.engine.alp
    w.engine.checkpoint_manager.checkpoint_config = CheckpointConfig(
        save_contents=["model", "optimizer", "extra"], load_contents=["model", "optimizer", "extra"])
    with torch.no_grad():
        alp.log_sigma.copy_(torch.tensor([-3.0, -4.0]))
    w.engine.save_checkpoint(str(tmp_path), global_step=1)
    assert (tmp_path / ALP_CHECKPOINT_FILE).exists()
    with torch.no_grad():
        alp.log_sigma.fill_(0.0)
    w.engine.load_checkpoint(str(tmp_path))
    assert alp.log_sigma.detach().tolist() == [-3.0, -4.0]
    assert alp.log_sigma in w.engine.optimizer.param_groups[-1]["params"]  # still the tensor the optimiser steps


def test_plugin_engine_recipe_on_the_packed_path(model_path):
    """verl's default ``use_remove_padding=True``: the micro-batch runs as one packed row [1, total_nnz] (no
    flash-attention here, so the rows attend across each other — irrelevant: the check is on the logits the forward
    produced). The engine's log-probs equal DVP's constrained log-prob of those logits at the rolled labels."""
    w = make_worker(model_path, {"sampling": {"min_p": 0.6}}, remove_padding=True)
    captured = []
    hook = w.engine.module.lm_head.register_forward_hook(lambda m, args, out: captured.append(out.detach().float()))
    try:
        from verl.utils import tensordict_utils as tu

        data = _batch({}, {"compute_loss": False, "temperature": TEMPERATURE})
        logp = tu.get(w.infer_batch(data), "log_probs")
    finally:
        hook.remove()
    input_ids = data["input_ids"]
    per_micro = [MICRO] * (B // MICRO)
    expected, plain, start = [], [], 0
    for logits, n in zip(captured, per_micro):  # one packed forward per micro-batch
        ids = torch.cat([input_ids[i] for i in range(start, start + n)])
        labels = torch.roll(ids, shifts=-1)
        z = logits.squeeze(0)[: ids.numel()] / TEMPERATURE
        expected.append(constrained_logp(z, labels, rho=0.6).logp)
        plain.append(z.log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1))
        start += n
    got = torch.cat([t for t in logp.unbind()]).float() if logp.is_nested else logp.flatten().float()
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-5, atol=1e-5)
    assert (got - torch.cat(plain)).abs().max() > 0.1  # the recipe changed them


# Top-K TRM: the engine's KL(μ ‖ π_old) bounds from the rollout's top-K, in the old-log-prob forward only
# ---------------------------------------------------------------------------------------------------------------

TOPK = 4
FAR = 2  # the sequence whose μ is far from π_old


def _rollout_topk(z: torch.Tensor):
    """μ = softmax((z + noise) / T) from π's logits ``z`` [B, R, V] (large noise on sequence FAR): its full log-probs
    [B, R, V] and its top-K ``(logp, ids)`` [B, R, K], as vLLM returns them (normalised over the vocabulary)."""
    noise = 0.05 * torch.randn(z.shape, generator=torch.Generator().manual_seed(5))
    noise[FAR] *= 60
    mu = ((z + noise) / TEMPERATURE).log_softmax(-1)
    lp, ids = mu.topk(TOPK, dim=-1)
    return mu, lp, ids


def _with_topk(data, lp: torch.Tensor, ids: torch.Tensor, short: int | None = None):
    """The batch with the top-K fields the agent loop stores (``sequence_topk`` per sample, nested like input_ids);
    sample ``short`` gets one row too few (as verl's synthetic padding samples carry a real sample's fields)."""
    from offpolicy.integrations.verl.topk import (
        TOPK_IDS_FIELD,
        TOPK_LOGP_FIELD,
        sequence_topk,
    )

    attention_mask = _inputs()[1]
    per_sample = [sequence_topk(int(attention_mask[i, :P].sum()), ids[i, :n].tolist(), lp[i, :n].tolist(), TOPK)
                  for i, n in enumerate(LENGTHS.tolist())]
    if short is not None:
        per_sample[short] = tuple(t[:-1] for t in per_sample[short])
    data[TOPK_LOGP_FIELD] = torch.nested.as_nested_tensor([s[0] for s in per_sample], layout=torch.jagged)
    data[TOPK_IDS_FIELD] = torch.nested.as_nested_tensor([s[1] for s in per_sample], layout=torch.jagged)
    return data


@pytest.fixture(scope="module")
def topk_worker(model_path, worker):
    return make_worker(model_path, {"topk_logprobs": TOPK, "correction": {"name": "trm", "avg_kl": None}})


def test_plugin_engine_computes_the_top_k_bounds_in_the_old_log_prob_forward(topk_worker, worker):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from offpolicy.divergence import token_kl, topk_kl_lower_bound, topk_kl_upper_bound
    from offpolicy.integrations.verl import apply_driver_correction, parse_settings
    from offpolicy.integrations.verl.topk import KL_LOWER_FIELD, KL_UPPER_FIELD

    w = topk_worker
    mask = _inputs()[1][:, P:]
    z = _reference_logits(w)
    mu, lp, ids = _rollout_topk(z)
    # verl's _compute_old_log_prob: no grad, entropy on, the rollout temperature
    meta = {"compute_loss": False, "calculate_entropy": True, "temperature": TEMPERATURE}
    data = _with_topk(_batch({}, meta), lp, ids)
    out = w.infer_batch(data)
    lower, upper = (no_padding_2_padding(tu.get(out, key), data).float() * mask for key in (KL_LOWER_FIELD,
                                                                                             KL_UPPER_FIELD))
    v = z.shape[-1]
    rows = (lp.reshape(-1, TOPK), ids.reshape(-1, TOPK), z.reshape(-1, v))
    exp_lower, exp_upper = (bound(*rows, temperature=TEMPERATURE).reshape(B, R) * mask
                            for bound in (topk_kl_lower_bound, topk_kl_upper_bound))
    torch.testing.assert_close(upper, exp_upper, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lower, exp_lower, rtol=1e-4, atol=1e-5)
    exact = token_kl(mu, z, temperature=TEMPERATURE) * mask  # μ is known in full here: lower ≤ exact ≤ upper
    assert (lower <= exact + 1e-5).all() and (exact <= upper + 1e-5).all()
    assert (upper - lower)[mask.bool()].min() > 0  # K < V: the bounds are not tight
    # the log-probs are verl's own (no recipe): the top-K only adds outputs
    plain = infer_logp(worker, {"temperature": TEMPERATURE})
    torch.testing.assert_close(no_padding_2_padding(tu.get(out, "log_probs"), data).float() * mask, plain,
                               rtol=1e-5, atol=1e-5)

    # TRM-Max on the certified bound, δ between the 4th and 5th of the eight sequences' maxima (a tiny random model
    # is nearly uniform over 64 tokens: the certified tail term q_rest · log(p_rest / π_min) dominates the bound)
    row_max = upper.max(-1).values
    ranked = row_max.sort().values
    delta = float((ranked[B // 2 - 1] + ranked[B // 2]) / 2)
    settings = parse_settings({"correction": {"name": "trm", "max_kl": delta, "avg_kl": None},
                               "topk_logprobs": TOPK})
    old = infer_logp(worker, {"temperature": TEMPERATURE})
    rollout = (mu.gather(-1, _inputs()[0][:, P:, None]).squeeze(-1)) * mask
    kept = apply_driver_correction({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask,
                                    "advantages": torch.ones(B, R), "token_divergence": upper}, settings)[0]
    expected = mask * (row_max <= delta)[:, None]  # the four sequences below δ kept, the four above masked
    assert int((row_max <= delta).sum()) == B // 2
    torch.testing.assert_close(kept["response_mask"], expected)

    # the reference forward (no entropy) and the update forward (grad on) compute no bounds
    ref = w.infer_batch(_with_topk(_batch({}, {"compute_loss": False, "temperature": TEMPERATURE}), lp, ids))
    assert KL_UPPER_FIELD not in ref.keys()  # noqa: SIM118 - TensorDict keys
    with torch.no_grad():
        assert w.engine._wants_topk_bounds(data)
    # a sample whose top-K does not fit its sequence (sample 3: 4 prompt + 1 response tokens): an error — unless it has no response token (verl's synthetic
    # padding sample), which gets a point mass and leaves the other samples' bounds alone
    with pytest.raises(ValueError, match="offpolicy_topk_ids: sample 3 has 4 rows for a sequence of 5 tokens"):
        w.infer_batch(_with_topk(_batch({}, meta), lp, ids, short=3))
    padded = _with_topk(_batch({}, meta), lp, ids, short=3)
    no_response = [m * (i != 3) for i, m in enumerate(padded["response_mask"].unbind())]
    padded["response_mask"] = torch.nested.as_nested_tensor(no_response, layout=torch.jagged)
    upper_padded = no_padding_2_padding(tu.get(w.infer_batch(padded), KL_UPPER_FIELD), data).float() * mask
    keep_rows = torch.arange(B) != 3
    torch.testing.assert_close(upper_padded[keep_rows], upper[keep_rows], rtol=1e-5, atol=1e-6)
    # the update (two mini-batches) runs with the top-K fields in the batch — verl hands the actor every field —
    # and gives the metrics and gradients it gives without them; its forward computes no bounds
    tensors = {"old_log_probs": old, "advantages": ADVANTAGES[:, None].expand(B, R).contiguous()}
    keys: list = []
    with_topk = _train(w, "vanilla", "token-mean", tensors, mini=B // 2, meta={"temperature": TEMPERATURE},
                       prepare=lambda d: _with_topk(d, lp, ids), output_keys=keys)
    without = _train(w, "vanilla", "token-mean", tensors, mini=B // 2, meta={"temperature": TEMPERATURE})
    def learning(metrics):  # timing and memory differ between any two runs
        return {k: v for k, v in metrics.items() if not (k.startswith("perf/") or k == "mfu")}

    assert learning(with_topk[0]) == learning(without[0]) and "actor/pg_loss" in learning(without[0])
    for a, b in zip(with_topk[1], without[1]):
        torch.testing.assert_close(a, b)
    assert keys and all(KL_UPPER_FIELD not in k for k in keys)


def test_plugin_engine_top_k_bounds_on_the_packed_path(model_path):
    """``use_remove_padding=True``: the bounds of each packed row equal ``topk_kl_upper_bound`` of the logits that row's
    forward produced, at the top-K the batch carries for it (prompt rows: the point mass)."""
    from verl.utils import tensordict_utils as tu

    from offpolicy.divergence import topk_kl_upper_bound
    from offpolicy.integrations.verl.topk import KL_UPPER_FIELD, TOPK_IDS_FIELD, TOPK_LOGP_FIELD

    w = make_worker(model_path, {"topk_logprobs": TOPK}, remove_padding=True)
    _, lp, ids = _rollout_topk(_reference_logits(w))
    data = _with_topk(_batch({}, {"compute_loss": False, "calculate_entropy": True, "temperature": TEMPERATURE}),
                      lp, ids)
    captured = []
    hook = w.engine.module.lm_head.register_forward_hook(lambda m, args, out: captured.append(out.detach().float()))
    try:
        upper = tu.get(w.infer_batch(data), KL_UPPER_FIELD)
    finally:
        hook.remove()
    expected, start = [], 0
    for logits in captured:  # one packed forward per micro-batch
        rows = range(start, start + MICRO)
        top_lp = torch.cat([data[TOPK_LOGP_FIELD][i] for i in rows])
        top_ids = torch.cat([data[TOPK_IDS_FIELD][i] for i in rows])
        expected.append(topk_kl_upper_bound(top_lp, top_ids, logits.squeeze(0)[: top_ids.shape[0]],
                                            temperature=TEMPERATURE))
        start += MICRO
    got = torch.cat([t for t in upper.unbind()]).float()
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-4, atol=1e-5)
    assert got.shape[0] == int(data["input_ids"].offsets()[-1])


# ---------------------------------------------------------------------------------------------------------------
# μ in the policy loss: verl's ppo_loss passes the policy loss no rollout log-probs; the plug-in's engine hands the
# micro-batch's rollout_log_probs to the plug-in's losses (IPO, M2PO on log π_θ − log μ)
# ---------------------------------------------------------------------------------------------------------------

IPO_DELTA = 0.005  # p ≈ 1/64 on this model; μ = π·e^(±0.5) moves p by up to ~0.01, so the band splits the tokens


@pytest.fixture(scope="module")
def mu_worker(model_path, worker):
    """The plug-in's engine with no recipe / ALP / top-K (the loss-side μ only) and two of its losses."""
    w = make_worker(model_path, {})
    register_verl_policy_loss("offpolicy_ipo_test", objective={"name": "ipo", "threshold": IPO_DELTA, "kl_tau": 0.0})
    register_verl_policy_loss("offpolicy_m2po_test", correction={"name": "m2po", "threshold": 0.05, "source": "total",
                                                                 "quadrants": False})
    return w


def _mu(current: torch.Tensor) -> torch.Tensor:
    mask = _inputs()[1][:, P:]
    return (current + 0.5 * torch.randn(B, R, generator=torch.Generator().manual_seed(11))) * mask


def test_plugin_engine_gives_ipo_the_rollout_log_probs(mu_worker, current_logp):
    # IPO (kl_tau = 0) in verl's actor path with μ from the batch; its gradient −A·(π_θ/μ)·1[|p − p_μ| ≤ δ]·∇log π_θ is
    # verl's own vanilla loss at ratio 1 (old = π_θ) with rollout_is_weights = (π_θ/μ)·1[|p − p_μ| ≤ δ]. π_old is
    # deliberately something else: IPO never reads it (prime-rl has no π_old)
    mask = _inputs()[1][:, P:].bool()
    mu = _mu(current_logp)
    advantages = ADVANTAGES[:, None].expand(B, R).contiguous()
    inside = ((current_logp.exp() - mu.exp()).abs() <= IPO_DELTA) & mask
    assert 0 < int(inside.sum()) < int(mask.sum())
    ours_metrics, ours_grad = _train(mu_worker, "offpolicy_ipo_test", "token-mean", {
        "old_log_probs": _old_logp(current_logp, True), "advantages": advantages, "rollout_log_probs": mu})
    weights = (current_logp - mu).exp() * inside
    verl_metrics, verl_grad = _train(mu_worker, "vanilla", "token-mean", {
        "old_log_probs": current_logp, "advantages": advantages, "rollout_is_weights": weights})
    assert verl_grad.abs().max() > 1e-3
    torch.testing.assert_close(ours_grad, verl_grad, rtol=1e-4, atol=1e-6)
    assert ours_metrics["actor/pg_loss"] == pytest.approx(verl_metrics["actor/pg_loss"], rel=1e-4)
    per_micro = [float((mask & ~inside)[r].sum() / mask[r].sum()) for r in (slice(0, MICRO), slice(MICRO, B))]
    assert ours_metrics["loss/ipo_masked"] == pytest.approx([sum(per_micro) / 2], rel=1e-5)  # verl: micro-batch mean


def test_plugin_engine_gives_m2po_total_the_rollout_log_probs(mu_worker, current_logp):
    # PPO + M2PO on log π_θ − log μ (arXiv 2510.01161; quadrants off), selected per micro-batch — the loss sees one
    # micro-batch at a time: equal to verl's vanilla with the kept tokens as rollout_is_weights (dropped tokens stay
    # in the token-mean denominator, as in offpolicy.policy_loss)
    from offpolicy import LogProbBatch
    from offpolicy.corrections.m2po import m2po

    mask = _inputs()[1][:, P:]
    mu = _mu(current_logp)
    advantages = ADVANTAGES[:, None].expand(B, R).contiguous()
    keep = torch.cat([m2po(threshold=0.05, source="total", quadrants=False)(
        LogProbBatch(logp=current_logp[r], rollout_logp=mu[r], mask=mask[r])).keep for r in (slice(0, 4), slice(4, 8))])
    assert 0 < int((mask.bool() & ~keep).sum()) < int(mask.sum())
    ours_metrics, ours_grad = _train(mu_worker, "offpolicy_m2po_test", "token-mean", {
        "old_log_probs": current_logp, "advantages": advantages, "rollout_log_probs": mu})
    verl_metrics, verl_grad = _train(mu_worker, "vanilla", "token-mean", {
        "old_log_probs": current_logp, "advantages": advantages, "rollout_is_weights": keep.float()})
    torch.testing.assert_close(ours_grad, verl_grad, rtol=1e-4, atol=1e-6)
    assert ours_metrics["actor/pg_loss"] == pytest.approx(verl_metrics["actor/pg_loss"], rel=1e-4)
    assert min(ours_metrics["m2po/masked_frac"]) > 0


def test_mu_reading_loss_on_verls_own_engine_is_refused(worker, mu_worker, current_logp):
    # verl's own engine does not hand the loss μ: the plug-in's IPO names what is missing instead of running without
    with pytest.raises(ValueError, match="rollout_log_probs: μ, read by ipo"):
        _train(worker, "offpolicy_ipo_test", "token-mean", {
            "old_log_probs": current_logp, "advantages": ADVANTAGES[:, None].expand(B, R).contiguous(),
            "rollout_log_probs": _mu(current_logp)})
