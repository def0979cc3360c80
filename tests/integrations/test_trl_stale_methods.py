"""M2PO (arXiv 2510.01161), IPO (prime-rl's ``ipo`` loss) and score centering on vLLM's top-K (arXiv 2609.20807)
inside TRL's real ``GRPOTrainer.train()`` on CPU.

μ exists in TRL only on its vLLM path (``sampling_per_token_logps``), so these run against the stub vLLM server
client of ``conftest.py`` (offpolicy's HF engine in bfloat16 with seeded logit noise: a real mismatch with the fp32
trainer). Without vLLM, M2PO and IPO are refused (there is no μ; the batch's fallback μ = π_old would make them
silent no-ops).

Skipped when TRL is not installed; they call TRL 1.16's internal methods, as the adapter overrides them."""

import pytest
import torch

from offpolicy import LogProbBatch, build_correction, policy_loss
from offpolicy.models.tiny import build_tiny_model

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
if not trl.__version__.startswith("1.16"):
    pytest.skip(f"overrides TRL 1.16's internal methods; installed {trl.__version__}", allow_module_level=True)

from offpolicy_testkit.trl_toy import logged, toy_dataset, varied_reward  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from offpolicy.integrations.trl import OffPolicyGRPOTrainer  # noqa: E402

NOISE = 0.5  # the stub engine's seeded logit noise: a mismatch large enough to mask (bf16 alone is ~1e-3 nats)


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                max_steps=2, report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", beta=0.0,
                seed=0, use_vllm=True, vllm_mode="server", vllm_importance_sampling_correction=False, temperature=1.0,
                loss_type="bnpo")
    return GRPOConfig(**{**base, **kw})


class _Capture(OffPolicyGRPOTrainer):
    """Keeps every generation batch TRL builds (what ``_compute_loss`` then receives)."""

    seen: list

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.seen.append(out)
        return out


def _trainer(tmp_path, stub_vllm, stub_vllm_client, *, args=None, **kw):
    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=0)
    stub_vllm["client"] = stub_vllm_client(model, tok, logit_noise=NOISE)
    _Capture.seen = []
    return _Capture(model=model, reward_funcs=varied_reward, args=args or _args(tmp_path), train_dataset=toy_dataset(),
                    processing_class=tok, **kw)


@pytest.mark.parametrize(("source", "quadrants"), [("total", True), ("mismatch", False)])
def test_m2po_runs_in_trls_train_and_masks_the_mismatch(tmp_path, stub_vllm, stub_vllm_client, source, quadrants):
    # the stub engine's logit noise (σ = 0.5) puts log π − log μ at about ±0.5 per token: M2 ≈ 0.2 > τ = 0.04 (the
    # paper's default), so M2PO drops tokens. "total" = the paper (π_θ/μ, PPO's active quadrants); "mismatch" without quadrants = AReaL's form
    # (π_old/μ over every token), which needs TRL's π_old forward: num_iterations = 2 makes TRL compute it
    iterations = 2 if source == "mismatch" else 1
    tau = 0.04
    trainer = _trainer(tmp_path, stub_vllm, stub_vllm_client, args=_args(tmp_path, num_iterations=iterations),
                       correction={"name": "m2po", "threshold": tau, "source": source, "quadrants": quadrants})
    trainer.train()
    masked = logged(trainer, "offpolicy/m2po/masked_frac")
    candidates = logged(trainer, "offpolicy/m2po/candidate_frac")
    before, after = logged(trainer, "offpolicy/m2po/m2_before"), logged(trainer, "offpolicy/m2po/m2_after")
    assert len(masked) == 2 and any(m > 0.0 for m in masked) and all(m < 1.0 for m in masked)
    for m, c, b, a in zip(masked, candidates, before, after):
        assert m <= c  # only candidates are dropped
        if b <= tau:  # already inside the bound: nothing to drop
            assert m == 0.0 and a == pytest.approx(b)
        else:  # the bound holds after the drop, or every candidate is gone (Algorithm 1)
            assert m > 0.0 and (a <= tau or m == c)
    if not quadrants:  # every token a candidate: the bound is always reached by dropping the largest (log r)²
        assert all(a <= tau < b for b, a in zip(before, after))
    out = trainer.seen[0]
    assert out["sampling_per_token_logps"] is not None
    assert (out.get("old_per_token_logps") is not None) == (source == "mismatch")


def _loss_and_grad(model, loss_fn):
    model.train()
    model.zero_grad()
    loss = loss_fn()
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize(("correction", "objective", "flag"), [
    ({"name": "m2po", "quadrants": False}, None, "m2po/masked_frac"),
    # the TV gate on |π_old(y) − μ(y)|: p ≈ 2.5e-4 on this near-uniform model, the noise moves it by ~1e-4
    ({"name": "gated_is", "gating": "tv", "upper": 1e-4}, None, "gated_is/masked_frac"),
    (None, {"name": "ipo", "threshold": 1e-4}, "loss/ipo_masked"),
])
def test_loss_and_gradient_equal_policy_loss_on_trls_batch(tmp_path, stub_vllm, stub_vllm_client, correction,
                                                           objective, flag):
    # one generation batch from TRL's own pipeline (stub vLLM: μ ≠ π_θ); the adapter's _compute_loss equals
    # offpolicy.policy_loss on a LogProbBatch built by hand from TRL's tensors (π_θ from TRL's own forward), in value
    # and gradient; loss_type bnpo = token_mean, divided by TRL's accumulation steps (1 here)
    trainer = _trainer(tmp_path, stub_vllm, stub_vllm_client, correction=correction, objective=objective)
    data = toy_dataset()
    out = trainer._generate_and_score_completions([data[i] for i in range(2)] * 2)
    t = out["completion_ids"].shape[1]
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    mu, mask = out["sampling_per_token_logps"], out["completion_mask"]
    assert bool((out["advantages"] != 0).any())

    metrics = {}

    def reference():
        logp = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, att, t)[0]
        batch = LogProbBatch(logp=logp, mask=mask, rollout_logp=mu, advantages=out["advantages"])
        loss, m = policy_loss(batch, correction=build_correction(correction),
                              objective=objective or {"name": "ppo", "clip_low": 0.2, "clip_high": 0.2},
                              aggregation="token_mean")
        metrics.update(m)
        return loss

    ours, g_ours = _loss_and_grad(trainer.model, lambda: trainer._compute_loss(trainer.model, dict(out)))
    ref, g_ref = _loss_and_grad(trainer.model, reference)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
    assert ((g_ours - g_ref).norm() / g_ref.norm()).item() < 1e-5
    # the method really acted on this batch: something masked, not everything
    assert 0.0 < float(metrics[flag]) < 1.0
    assert trainer._metrics["train"][f"offpolicy/{flag}"][-1] == pytest.approx(float(metrics[flag]))


def test_ipo_runs_in_trls_train_with_the_engines_mu(tmp_path, stub_vllm, stub_vllm_client):
    # IPO, δ = 1e-4: on this near-uniform random model p ≈ 2.5e-4 and the engine's logit noise moves p_μ by a few
    # 1e-5 … 3e-4, so |p − p_μ| straddles δ: tokens are masked in each step (not all); the penalty τ_kl·(log π_θ/μ)² keeps every token; the trainer's weights move
    trainer = _trainer(tmp_path, stub_vllm, stub_vllm_client,
                       objective={"name": "ipo", "threshold": 1e-4, "kl_tau": 1e-3})
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    masked = logged(trainer, "offpolicy/loss/ipo_masked")
    assert len(masked) == 2 and all(m > 0.0 for m in masked) and min(masked) < 1.0
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))
    assert all(out["sampling_per_token_logps"] is not None for out in trainer.seen)  # vLLM's μ reached the loss


@pytest.mark.parametrize(("kw", "named"), [
    ({"correction": {"name": "m2po"}}, "m2po"),
    ({"correction": ["icepop", {"name": "m2po", "source": "mismatch"}]}, "m2po"),
    ({"objective": "ipo"}, "ipo"),
])
def test_without_vllm_m2po_and_ipo_are_refused(tmp_path, kw, named):
    # HF generate gives TRL no μ: the batch would fall back to μ = π_old and M2PO / IPO would silently do nothing
    model, tok = build_tiny_model(seed=0)
    args = _args(tmp_path, use_vllm=False)
    with pytest.raises(ValueError, match=f"use_vllm: the engine's log-probs μ.* are read by {named}; set use_vllm=True") as err:
        OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(), processing_class=tok,
                             **kw)
    assert "\n" not in str(err.value)


def test_a_batch_without_mu_is_refused_in_the_loss(tmp_path, stub_vllm, stub_vllm_client):
    # the vLLM path without log-probs (a rollout_func that returns none): the loss names the missing field
    trainer = _trainer(tmp_path, stub_vllm, stub_vllm_client, objective="ipo")
    out = trainer._generate_and_score_completions([toy_dataset()[i] for i in range(2)] * 2)
    out["sampling_per_token_logps"] = None
    with pytest.raises(ValueError, match="sampling_per_token_logps: TRL's batch has no vLLM log-probs μ, which ipo read"):
        trainer._compute_loss(trainer.model, out)



def test_score_centering_on_vllms_top_k_in_trls_train(tmp_path, stub_vllm, stub_vllm_client):
    # score centering (arXiv 2609.20807) from the stub server's top-4: train() runs it and logs the head's mass; on one
    # TRL generation batch _compute_loss has the value of the uncentred loss and the gradient of a reference built from
    # the model's full logits: log p(y) − c + sg(c), c = score_center_topk(logits, top-4 ids, top-4 log q)
    from offpolicy.objectives.score_centering import centered_logp, score_center_topk, topk_drift_tv

    k = 4
    trainer = _trainer(tmp_path, stub_vllm, stub_vllm_client, topk_logprobs=k, score_centering=True,
                       objective="reinforce")
    trainer.train()
    head = logged(trainer, "offpolicy/score_centering/head_mass_q")
    drift = logged(trainer, "offpolicy/score_centering/drift_tv")  # the trainer's and verl's names too
    assert len(head) == 2 and all(0.0 < h < 1.0 for h in head)
    assert len(drift) == 2 and all(0.0 <= d < 1.0 for d in drift)
    # no TRM reads the certified bounds here: they are not computed (their tail sort costs more than the centre)
    assert not trainer.offpolicy_topk_bounds and logged(trainer, "offpolicy/topk/kl_upper_mean") == []

    out = trainer._generate_and_score_completions([toy_dataset()[i] for i in range(2)] * 2)
    t = out["completion_ids"].shape[1]
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    mask = out["completion_mask"]
    lp_k, id_k = out["offpolicy_topk_logp"], out["offpolicy_topk_ids"]

    def reference(centre):
        logits = trainer.model(input_ids=ids, attention_mask=att).logits[:, -t - 1:-1].float()  # temperature 1
        logp = torch.log_softmax(logits, -1).gather(-1, out["completion_ids"][..., None]).squeeze(-1)
        if centre:
            valid = mask.bool()
            c = torch.zeros_like(logp).masked_scatter(valid, score_center_topk(logits[valid], id_k[valid], lp_k[valid]))
            logp = centered_logp(logp, c)
        batch = LogProbBatch(logp=logp, mask=mask, rollout_logp=out["sampling_per_token_logps"],
                             advantages=out["advantages"])
        return policy_loss(batch, objective="reinforce", aggregation="token_mean")[0]

    trainer._metrics["train"].clear()
    ours, g_ours = _loss_and_grad(trainer.model, lambda: trainer._compute_loss(trainer.model, dict(out)))
    with torch.no_grad():  # the logged drift: the top-4 estimate ½‖q̂ − p‖₁ over the completion tokens
        logits = trainer.model(input_ids=ids, attention_mask=att).logits[:, -t - 1:-1].float()
        valid = mask.bool()
        want = topk_drift_tv(logits[valid], id_k[valid], lp_k[valid]).mean().item()
    assert trainer._metrics["train"]["offpolicy/score_centering/drift_tv"] == [pytest.approx(want, rel=1e-4)]
    ref, g_ref = _loss_and_grad(trainer.model, lambda: reference(True))
    plain, g_plain = _loss_and_grad(trainer.model, lambda: reference(False))
    torch.testing.assert_close(ours, plain, atol=1e-6, rtol=1e-5)  # centring leaves the value alone
    # the centring's own part of the gradient (small on this near-uniform model: q̂ − p against onehot(y) − p)
    # equals the reference's
    d_ours, d_ref = g_ours - g_plain, g_ref - g_plain
    assert d_ref.norm() > 1e-4 * g_plain.norm()
    assert ((d_ours - d_ref).norm() / d_ref.norm()).item() < 1e-2


@pytest.mark.parametrize(("kw", "match"), [
    ({"score_centering": True}, "set topk_logprobs=K"),
    ({"score_centering": True, "topk_logprobs": 4, "sampling_replay": True}, "not with sampling_replay"),
    ({"score_centering": "yes", "topk_logprobs": 4}, "must be a bool"),
])
def test_score_centering_settings_are_checked(tmp_path, kw, match):
    model, tok = build_tiny_model(seed=0)
    with pytest.raises(ValueError, match=f"score_centering.*{match}"):
        OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=_args(tmp_path), train_dataset=toy_dataset(),
                             processing_class=tok, **kw)


@pytest.mark.parametrize(("kw", "bounds"), [
    ({"topk_logprobs": 4}, True),  # the top-K alone: its bounds are the diagnostic asked for
    ({"topk_logprobs": 4, "correction": "trm"}, True),
    ({"topk_logprobs": 4, "score_centering": True}, False),
    ({"topk_logprobs": 4, "score_centering": True, "correction": ["tis", "trm"]}, True),  # a TRM in a chain reads them
])
def test_the_certified_bounds_are_computed_where_something_reads_them(tmp_path, stub_vllm, stub_vllm_client, kw,
                                                                      bounds):
    assert _trainer(tmp_path, stub_vllm, stub_vllm_client, **kw).offpolicy_topk_bounds is bounds
