"""The seed methods inside TRL's real ``GRPOTrainer.train()`` on CPU (a tiny random Qwen2, a few steps each):
DVP / sampling replay with HF generate, ALP (σ's gradient, noise-free π_old, σ out of ``save_pretrained``, σ restored
on resume), and TRM on the engine's top-k through a stub vLLM server client (a live vLLM cannot run here).

Skipped when TRL is not installed; they call TRL 1.16's internal methods (``_generate_and_score_completions``,
``_get_per_token_logps_and_entropies``), as the adapter overrides them."""

import math

import pytest
import torch

from offpolicy.models.tiny import build_tiny_model

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
if not trl.__version__.startswith("1.16"):
    pytest.skip(f"overrides TRL 1.16's internal methods; installed {trl.__version__}", allow_module_level=True)

from offpolicy_testkit.trl_toy import logged, toy_dataset, varied_reward  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from offpolicy.integrations.trl import OffPolicyGRPOTrainer  # noqa: E402


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                max_steps=2, report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", beta=0.0,
                seed=0)
    return GRPOConfig(**{**base, **kw})


def _ids(out):
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    return ids, att, out["completion_ids"].shape[1]


class _Probe(OffPolicyGRPOTrainer):
    """Scores every generation batch right after it is sampled, with the weights that sampled it."""

    probes: list

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        ids, att, t = _ids(out)
        with torch.no_grad():
            s = self._offpolicy_scores(self.model, ids, att, t)
        self.probes.append((s.inside, out["completion_mask"].bool(), s.mass))
        return out


def test_dvp_with_hf_generate_samples_inside_the_trainers_safe_set(tmp_path):
    # DVP, ρ = 0.2: TRL's HF generate samples with min_p = 0.2 and the trainer scores π_old and π_θ with the same
    # min-p safe set at the same temperature: every sampled token is inside it (dvp/outside_frac = 0), and the safe
    # set really prunes (retained mass < 1: at temperature 0.25 the tiny random model is peaked enough)
    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=0)
    _Probe.probes = []
    trainer = _Probe(model=model, reward_funcs=varied_reward, args=_args(tmp_path, temperature=0.25), train_dataset=toy_dataset(),
                     processing_class=tok, dvp_rho=0.2)
    assert trainer.args.min_p == 0.2 and trainer.generation_config.min_p == 0.2  # the engine got ρ
    trainer.train()
    assert len(trainer.probes) == 2
    for inside, mask, mass in trainer.probes:
        assert bool(inside[mask].all())
        assert 0.0 < float(mass[mask].mean()) < 0.999
    assert logged(trainer, "offpolicy/dvp_keep/masked_frac") == [0.0, 0.0]
    assert all(m < 0.999 for m in logged(trainer, "offpolicy/dvp/mass_mean"))
    assert len(logged(trainer, "offpolicy/loss/ratio_mean")) == 2


def test_replay_of_top_k_top_p_and_repetition_penalty_in_trls_loop(tmp_path):
    # HF generate with temperature, top-k, top-p and a repetition penalty on prompts of different lengths (TRL pads
    # them on the left; HF's penalty sees the pad tokens): the chunked replay puts every sampled token inside the
    # trainer's support, with the weights that sampled it, in both steps
    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=0)
    _Probe.probes = []
    data = datasets.Dataset.from_list([{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(6, 14)])
    args = _args(tmp_path, temperature=0.5, top_k=40, top_p=0.9, repetition_penalty=1.3)
    trainer = _Probe(model=model, reward_funcs=varied_reward, args=args, train_dataset=data, processing_class=tok,
                     sampling_replay=True, memory_budget_bytes=2**20)
    assert trainer.offpolicy_recipe.processors == ("repetition_penalty", "temperature", "top_k", "top_p")
    trainer.train()
    for inside, mask, mass in trainer.probes:
        assert bool(inside[mask].all()) and float(mass[mask].max()) <= 1.0
    assert logged(trainer, "offpolicy/dvp_keep/masked_frac") == [0.0, 0.0]
    assert all(m < 1.0 for m in logged(trainer, "offpolicy/dvp/mass_mean"))


def test_replay_without_a_recipe_equals_trls_own_log_probs_and_loss(tmp_path):
    # sampling replay on with no truncation (temperature 0.7 only): the chunked replay from the captured hidden
    # states equals TRL's fused head — the per-token log-probs (π_old's forward) and _compute_loss's value and gradient
    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=0)
    trainer = OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=_args(tmp_path, temperature=0.7),
                                   train_dataset=toy_dataset(), processing_class=tok, sampling_replay=True)
    assert trainer.offpolicy_recipe.processors == ("temperature",)
    out = trainer._generate_and_score_completions([toy_dataset()[i] for i in range(2)] * 2)
    ids, att, t = _ids(out)
    with torch.no_grad():
        ours = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, t)[0]
        theirs = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, att, t)[0]
    mask = out["completion_mask"].bool()
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-5, rtol=1e-5)
    assert bool((ours[~mask] == 0).all())

    def loss_and_grad(recipe):
        trainer.offpolicy_recipe = recipe
        trainer._offpolicy_keep = trainer._offpolicy_keep if recipe is not None else None
        trainer.model.train()
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, dict(out))
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])

    replay = trainer.offpolicy_recipe
    loss_ours, g_ours = loss_and_grad(replay)
    loss_theirs, g_theirs = loss_and_grad(None)
    torch.testing.assert_close(loss_ours, loss_theirs, atol=1e-6, rtol=1e-5)
    assert ((g_ours - g_theirs).norm() / g_theirs.norm()).item() < 1e-4


class _CountNoise(OffPolicyGRPOTrainer):
    """Counts ALP's noisy forwards inside generation / π_old scoring and inside the loss."""

    noisy: dict

    def _generate_and_score_completions(self, inputs):
        self._phase = "generation"
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._phase = "update"
        # π_old as TRL computed it == a forward with ALP's hooks off
        ids, att, t = _ids(out)
        with torch.no_grad(), self.offpolicy_alp.active(False):
            clean = GRPOTrainer._get_per_token_logps_and_entropies(self, self.model, ids, att, t)[0]
        self.noisy["old_equals_clean"].append(bool(torch.equal(out["old_per_token_logps"], clean)))
        return out


def test_alp_noise_in_the_update_only_sigma_learns_saved_apart_and_restored(tmp_path):
    # num_iterations = 2: TRL computes π_old in a separate no-grad forward (the one that must stay noise-free)
    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=0)
    _CountNoise.noisy = {"generation": 0, "update": 0, "old_equals_clean": []}
    args = _args(tmp_path, num_iterations=2, max_steps=2, save_strategy="steps", save_steps=1)
    trainer = _CountNoise(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(), processing_class=tok,
                          alp={"init_std": 0.05, "lr": 0.05, "seed": 0})
    alp = trainer.offpolicy_alp
    real_noisy = alp._noisy

    def counting(h, i):
        _CountNoise.noisy[getattr(trainer, "_phase", "update")] += 1
        return real_noisy(h, i)

    alp._noisy = counting
    init = alp.log_sigma.detach().clone()
    trainer.train()
    assert _CountNoise.noisy["generation"] == 0 and _CountNoise.noisy["update"] > 0
    assert _CountNoise.noisy["old_equals_clean"] == [True]  # one generation batch, reused for 2 iterations
    assert any(g.get("name") == "alp" for g in trainer.optimizer.param_groups)
    assert not torch.equal(alp.log_sigma.detach(), init)  # σ got a gradient and moved
    assert alp.log_sigma.grad is None  # dropped after each optimiser step (the Trainer zeroes only the model's)
    sigma_logged = logged(trainer, "offpolicy/alp/sigma_mean")
    assert len(sigma_logged) == 2 and sigma_logged[0] == pytest.approx(0.05, rel=0.2)
    # save_pretrained: the model's own tensors, no σ
    from safetensors.torch import load_file

    trainer.save_model(str(tmp_path / "final"))
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert not any("sigma" in k for k in saved) and set(saved) <= set(trainer.model.state_dict())
    # checkpoints carry σ; resuming from checkpoint-1 restores it before training goes on
    ckpt1 = tmp_path / "checkpoint-1"
    assert (ckpt1 / "offpolicy_alp.pt").exists()
    sigma1 = torch.load(ckpt1 / "offpolicy_alp.pt", weights_only=True)["state_dict"]["log_sigma"]
    assert not torch.equal(sigma1, init)
    model2, _ = build_tiny_model(seed=0)
    resumed = OffPolicyGRPOTrainer(model=model2, reward_funcs=varied_reward, args=_args(tmp_path, max_steps=1),
                                   train_dataset=toy_dataset(), processing_class=tok,
                                   alp={"init_std": 0.05, "lr": 0.05, "seed": 0})  # the same settings: resumable
    assert torch.equal(resumed.offpolicy_alp.log_sigma.detach(), init)
    from transformers import TrainerCallback

    at_start = []

    class SigmaAtStart(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            at_start.append(resumed.offpolicy_alp.log_sigma.detach().clone())

    resumed.add_callback(SigmaAtStart())
    resumed.train(resume_from_checkpoint=str(ckpt1))
    assert len(at_start) == 1 and torch.equal(at_start[0], sigma1)


@pytest.mark.parametrize("dvp_rho", [None, 0.05])
def test_topk_trm_through_a_stub_vllm_server(tmp_path, stub_vllm, stub_vllm_client, dvp_rho):
    # vLLM (server mode) asked for K = 4 log-probs per token: μ is the sampled token's entry (not the top-1's, which
    # TRL keeps), the top-4 reach the loss through TRL's batch, TRM uses the certified upper bound; ALP on too, to
    # check that the weight sync never sends σ
    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=0)
    stub_vllm["client"] = client = stub_vllm_client(model, tok)
    args = _args(tmp_path, use_vllm=True, vllm_mode="server", vllm_importance_sampling_correction=False,
                 temperature=1.0, max_steps=2)
    seen = []

    class Capture(OffPolicyGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            seen.append(out)
            return out

    trainer = Capture(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(), processing_class=tok,
                      topk_logprobs=4, correction={"name": "trm", "max_kl": 0.05, "avg_kl": None},
                      alp={"init_std": 0.01}, dvp_rho=dvp_rho)
    assert trainer.vllm_generation.logprobs == 4
    trainer.train()
    assert len(seen) == 2 and client.synced and not any("sigma" in n for n in client.synced)
    mask = seen[0]["completion_mask"].bool()
    sampled = seen[0]["sampling_per_token_logps"]
    want = torch.zeros_like(sampled)
    top1 = torch.zeros_like(sampled)
    for i in range(len(client.sampled[:4])):
        want[i, : len(client.sampled[i])] = torch.tensor(client.sampled[i])
        top1[i, : len(client.top1[i])] = torch.tensor(client.top1[i])
    torch.testing.assert_close(sampled[mask], want[mask])
    assert bool((sampled[mask] != top1[mask]).any())  # what TRL's lp[0] would have been: a different value
    lp, ids = seen[0]["offpolicy_topk_logp"], seen[0]["offpolicy_topk_ids"]
    assert lp.shape == ids.shape == (*mask.shape, 4)
    assert logged(trainer, "offpolicy/trm/divergence_topk") == [1.0, 1.0]
    lower, upper = logged(trainer, "offpolicy/topk/kl_lower_mean"), logged(trainer, "offpolicy/topk/kl_upper_mean")
    assert all(0.0 <= lo <= up and math.isfinite(up) for lo, up in zip(lower, upper))
    assert len(logged(trainer, "offpolicy/trm/masked_seq_frac")) == 2
    if dvp_rho is not None:  # the engine got min_p = ρ; the trainer replays it in vLLM's order
        assert trainer.vllm_generation.min_p == dvp_rho and trainer.offpolicy_order == ("min_p", "top_k", "top_p")
        assert len(logged(trainer, "offpolicy/dvp_keep/masked_frac")) == 2


def test_a_raw_logprobs_vllm_server_is_refused(tmp_path, stub_vllm, stub_vllm_client):
    model, tok = build_tiny_model(seed=0)
    stub_vllm["client"] = stub_vllm_client(model, tok, logprobs_mode="raw_logprobs")
    args = _args(tmp_path, use_vllm=True, vllm_mode="server", vllm_importance_sampling_correction=False)
    with pytest.raises(ValueError, match="logprobs_mode"):
        OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(), processing_class=tok)


BF16_METHODS = {
    "dvp": dict(dvp_rho=0.2, args=dict(temperature=0.25)),
    "sampling_replay": dict(sampling_replay=True, args=dict(temperature=0.5, top_k=40, top_p=0.9)),
    "alp": dict(alp={"init_std": 0.05, "lr": 0.05, "seed": 0}),
    "tis": dict(correction={"name": "tis", "upper": 2.0}),
}


@pytest.mark.parametrize("name", sorted(BF16_METHODS))
def test_a_bf16_policy_trains_under_every_head_reading_method(tmp_path, name):
    """The policy's own parameters bf16 with ``GRPOConfig(bf16=True)``, as a GPU user runs: each method that reads
    the head or the hidden states trains two steps in TRL's loop, its metrics finite and the bf16 weights moving.
    Score centering and top-K TRM need vLLM's top-K: tests/vllm/test_trl_live.py runs them."""
    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=0)
    model = model.to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    kw = dict(BF16_METHODS[name])
    args = _args(tmp_path, bf16=True, learning_rate=1e-3, **kw.pop("args", {}))
    trainer = OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(),
                                   processing_class=tok, **kw)
    trainer.train()
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    losses = logged(trainer, "loss")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    ratios = logged(trainer, "offpolicy/loss/ratio_mean")
    assert len(ratios) == 2 and all(math.isfinite(x) for x in ratios)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


# the methods published since September, by name, with HF generate (no engine log-probs: μ = π_old), 2 steps each:
# calibrated IS is then the identity, calibrated clipping plain PPO (nothing widened), and the delight gate — which
# reads no μ — gates every token into (0, 1)
RECENT_METHODS = {
    "calibrated_is": (dict(correction={"name": "calibrated_is"}), "offpolicy/calibrated_is/weight_mean"),
    "delight": (dict(correction={"name": "delight"}), "offpolicy/delight/weight_mean"),
    "calibrated_clip": (dict(objective="calibrated_clip"), "offpolicy/loss/calibrated_widened_low"),
}


@pytest.mark.parametrize("name", sorted(RECENT_METHODS))
def test_recent_methods_train_by_name_with_hf_generate(tmp_path, name):
    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    kw, metric = RECENT_METHODS[name]
    trainer = OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=_args(tmp_path, learning_rate=1e-3),
                                   train_dataset=toy_dataset(), processing_class=tok, **kw)
    trainer.train()
    losses, values = logged(trainer, "loss"), logged(trainer, metric)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and len(values) == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    if name == "calibrated_is":
        assert values == [1.0, 1.0] and logged(trainer, "offpolicy/calibrated_is/capped_frac") == [0.0, 0.0]
    elif name == "calibrated_clip":
        assert values == [0.0, 0.0] and logged(trainer, "offpolicy/loss/calibrated_widened_high") == [0.0, 0.0]
    else:
        assert all(0.0 < v < 1.0 for v in values)
