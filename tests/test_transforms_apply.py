"""``apply_transforms``: the one batch step every host runs, checked against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.batch import LogProbBatch
from offpolicy.objectives.score_centering import score_center, score_center_topk
from offpolicy.registry import TRANSFORMS, register_transform
from offpolicy.transforms import SCORE_CENTER, TOPK_KL_LOWER, TOPK_KL_UPPER, apply_transforms, forward_extras


def _batch(logp, **kw):
    return LogProbBatch(logp=logp, mask=torch.ones(logp.shape, dtype=torch.bool), **kw)


def test_score_centering_keeps_the_value_and_centres_the_gradient_on_q():
    # z = (1, 0, −1): p = (0.6652, 0.2447, 0.0900); y = 1; q = (0.2, 0.5, 0.3)
    z = torch.tensor([[[1.0, 0.0, -1.0]]], requires_grad=True)
    q = torch.tensor([[[0.2, 0.5, 0.3]]])
    logp = torch.log_softmax(z, -1)[..., 1]
    c = score_center(z, q.log())
    out = apply_transforms(_batch(logp, extras=forward_extras(center=c)), ["score_centering"])
    assert out.logp.item() == logp.item() and SCORE_CENTER not in out.extras
    grad = torch.autograd.grad(out.logp.sum(), z)[0]
    # ∇ log p(y) − E_q[∇ log p] = (onehot(y) − p) − (q − p) = onehot(y) − q
    assert torch.allclose(grad, torch.tensor([[[-0.2, 0.5, -0.3]]]), atol=1e-6)


def test_score_centering_on_policy_leaves_the_score_as_it_is_up_to_its_mean():
    # q = p (on-policy): E_p[∇ log p] = 0, so the centred score is the plain one
    torch.manual_seed(0)
    z = torch.randn(2, 3, 5, requires_grad=True)
    y = torch.randint(0, 5, (2, 3))
    logp = torch.log_softmax(z, -1).gather(-1, y[..., None]).squeeze(-1)
    c = score_center(z, torch.log_softmax(z, -1).detach())
    plain = torch.autograd.grad(logp.sum(), z, retain_graph=True)[0]
    out = apply_transforms(_batch(logp, extras=forward_extras(center=c)), ["score_centering"])
    assert torch.allclose(torch.autograd.grad(out.logp.sum(), z)[0], plain, atol=1e-6)


def test_score_centering_top_k_centre_from_the_head_pass_formula():
    # the centre TRL's and verl's forward compute: z = 0 over 3 tokens, head {0} with q = 0.6: κ = 0.6,
    # ∇c = q̂ − p with q̂ = (0.6, 0.2, 0.2): the centred gradient at y = 1 is onehot(1) − q̂ = (−0.6, 0.8, −0.2)
    z = torch.zeros(1, 1, 3, requires_grad=True)
    logp = torch.log_softmax(z, -1)[..., 1]
    c = score_center_topk(z, torch.tensor([[[0]]]), torch.tensor([[[0.6]]]).log())
    out = apply_transforms(_batch(logp, extras=forward_extras(center=c)),
                           [{"name": "score_centering", "source": "topk"}])
    assert torch.allclose(torch.autograd.grad(out.logp.sum(), z)[0], torch.tensor([[[-0.6, 0.8, -0.2]]]), atol=1e-6)


def test_padding_never_reaches_the_loss_through_the_centre():
    z = torch.zeros(1, 2, 3, requires_grad=True)
    logp = torch.log_softmax(z, -1)[..., 0]
    c = score_center(z, torch.tensor([[[0.2, 0.5, 0.3], [1.0, 0.0, 0.0]]]).clamp_min(1e-30).log())
    batch = LogProbBatch(logp=logp, mask=torch.tensor([[True, False]]), old_logp=logp.detach(),
                         advantages=torch.ones(1), extras=forward_extras(center=c))
    loss, _ = op.policy_loss(apply_transforms(batch, ["score_centering"]))
    grad = torch.autograd.grad(loss, z)[0]
    assert torch.equal(grad[0, 1], torch.zeros(3))  # the padded position: nothing
    assert torch.allclose(grad[0, 0], -(torch.tensor([1.0, 0.0, 0.0]) - torch.tensor([0.2, 0.5, 0.3])), atol=1e-6)


def test_topk_bounds_picks_the_bound_trm_reads():
    lower, upper = torch.tensor([[0.01, 0.02]]), torch.tensor([[0.05, 0.5]])
    batch = _batch(torch.zeros(1, 2), extras={**forward_extras(kl_lower=lower, kl_upper=upper),
                                              "dvp_keep": torch.ones(1, 2, dtype=torch.bool)})
    up = apply_transforms(batch, [{"name": "topk_bounds", "k": 8}])
    assert torch.equal(up.token_divergence, upper) and up.token_divergence_kind == "topk"
    assert set(up.extras) == {"dvp_keep"}  # the forward's other results stay for their correction
    low = apply_transforms(batch, [{"name": "topk_bounds", "k": 8, "bound": "lower"}])
    assert torch.equal(low.token_divergence, lower)
    # TRM's test reads it: max KL 0.5 > 0.1 rejects the sequence with the certified bound, not with the lower one
    trm = op.build_correction({"name": "trm", "max_kl": 0.1, "avg_kl": 1.0})
    for b, kept in ((up, False), (low, True)):
        b = b.replace(old_logp=b.logp, rollout_logp=b.logp)
        assert bool(trm(b).keep.all()) is kept
    assert TOPK_KL_LOWER in batch.extras and TOPK_KL_UPPER in batch.extras  # the input batch is not changed


def test_forward_only_transforms_and_a_batch_without_the_forward_results_pass_through():
    batch = _batch(torch.full((1, 2), -1.0))
    out = apply_transforms(batch, ["dvp", "sampling_replay", "alp", "exact_kl", "proximal", "score_centering",
                                   {"name": "topk_bounds", "k": 2}])
    assert out is batch


def test_plugins_run_in_order_and_a_bad_return_is_named():
    @register_transform("plus_one", provides="logp")
    def plus_one(batch):
        return batch.replace(logp=batch.logp + 1.0)

    @register_transform("times", provides="logp")
    def times(batch, by: float = 2.0):
        return batch.replace(logp=batch.logp * by)

    @register_transform("forgets_to_return")
    def forgets(batch):
        batch.replace(logp=batch.logp)

    try:
        batch = _batch(torch.full((1, 1), -1.0))
        assert apply_transforms(batch, ["plus_one", "times"]).logp.item() == 0.0  # (−1 + 1)·2
        assert apply_transforms(batch, [{"name": "times", "by": 3.0}, "plus_one"]).logp.item() == -2.0  # −1·3 + 1
        with pytest.raises(ValueError, match=r"^transform 'forgets_to_return': must return a LogProbBatch .*NoneType"):
            apply_transforms(batch, ["forgets_to_return"])
        with pytest.raises(ValueError, match="^unknown transform 'plus_two'"):
            apply_transforms(batch, ["plus_two"])
    finally:
        for name in ("plus_one", "times", "forgets_to_return"):
            TRANSFORMS.unregister(name)


def test_the_centred_logp_keeps_a_ratio_of_one_on_policy():
    # value unchanged: π_θ/π_old = 1 on-policy, whatever the centre
    z = torch.tensor([[[0.3, -0.2]]], requires_grad=True)
    logp = torch.log_softmax(z, -1)[..., 0]
    c = score_center(z, torch.tensor([[[0.5, 0.5]]]).log())
    out = apply_transforms(LogProbBatch(logp=logp, mask=torch.ones(1, 1), old_logp=logp.detach(),
                                        advantages=torch.ones(1), extras=forward_extras(center=c)),
                           ["score_centering"])
    _, metrics = op.policy_loss(out)
    assert math.isclose(float(metrics["loss/ratio_mean"]), 1.0, abs_tol=1e-7)


def test_alp_with_score_centering_is_alps_value_with_the_centred_score():
    # the update forward's noisy logits z + σε (ALP), the engine's μ and q: ALP alone gives
    # L = −A/T Σ_t r_t, r_t = π_{θ,σ}(y_t)/μ_t inside the clip range, ∂L/∂z_t = −A r_t/T (onehot(y_t) − p_t);
    # score centering replaces p_t by q_t in the score, the value unchanged
    from offpolicy.perturbation import alp_policy_loss

    eps = torch.tensor([[[0.3, -0.1, 0.2], [-0.4, 0.1, 0.0]]])
    z = (torch.tensor([[[1.0, 0.0, -1.0], [0.5, 0.5, 0.0]]]) + 0.1 * eps).requires_grad_(True)
    y = torch.tensor([[1, 0]])
    q = torch.tensor([[[0.2, 0.5, 0.3], [0.6, 0.3, 0.1]]])
    logp = torch.log_softmax(z, -1).gather(-1, y[..., None]).squeeze(-1)
    mu = logp.detach() + torch.tensor([[0.05, -0.05]])  # r = (e^−0.05, e^0.05): inside ALP's (0.8, 1.28)
    advantage = 1.5

    def loss(centre: bool):
        extras = forward_extras(center=score_center(z, q.log())) if centre else {}
        batch = LogProbBatch(logp=logp, mask=torch.ones(1, 2), rollout_logp=mu, advantages=torch.tensor([advantage]),
                             extras=extras)
        value, _ = alp_policy_loss(apply_transforms(batch, ["alp", "score_centering"]))
        return value, torch.autograd.grad(value, z, retain_graph=True)[0]

    r = torch.exp(torch.tensor([-0.05, 0.05]))
    p = torch.softmax(z.detach(), -1)[0]
    onehot = torch.nn.functional.one_hot(y[0], 3).float()
    alone, alone_grad = loss(False)
    both, both_grad = loss(True)
    assert math.isclose(alone.item(), -advantage * r.mean().item(), rel_tol=1e-6)
    assert both.item() == alone.item()  # the value is ALP's
    coefficient = (-advantage * r / 2)[:, None]
    assert torch.allclose(alone_grad[0], coefficient * (onehot - p), atol=1e-6)
    assert torch.allclose(both_grad[0], coefficient * (onehot - q[0]), atol=1e-6)


def test_the_fetch_plan_reads_the_needs_not_the_names():
    from offpolicy.transforms import FetchPlan, fetch_plan

    assert fetch_plan([]) == FetchPlan()
    assert fetch_plan(["score_centering"]) == FetchPlan(logits=True)  # exact: the engine's full logits
    assert fetch_plan([{"name": "score_centering", "source": "topk", "k": 5}]).topk == 5
    assert fetch_plan([{"name": "proximal", "method": "loglinear"}, "dvp"]) == FetchPlan(versions=True,
                                                                                           sampling_recipe=True)

    @register_transform("my_head", needs=("engine_topk",))
    def my_head(batch, k: int = 4):
        return batch

    @register_transform("no_k", needs=("engine_topk",))
    def no_k(batch):
        return batch

    try:
        assert fetch_plan(["my_head"]).topk == 4  # a plug-in's K, by the same rule as the built-ins'
        with pytest.raises(ValueError, match=r"^transforms.my_head.k=4 and transforms.topk_bounds.k=8: the engine "):
            fetch_plan(["my_head", {"name": "topk_bounds", "k": 8}])
        with pytest.raises(ValueError, match=r"^transform 'no_k' needs engine_topk but has no int parameter 'k'"):
            fetch_plan(["no_k"])
    finally:
        TRANSFORMS.unregister("my_head")
        TRANSFORMS.unregister("no_k")
