"""Registries: names resolve, unknown names and parameters fail listing what exists, a taken name is refused, specs
build the same corrections as the factories, and every registered correction and objective behaves (parametrised
over the registries, so a new one is tested the moment it is registered)."""

from __future__ import annotations

import pytest
import torch

import offpolicy as op
from offpolicy.registry import AGGREGATIONS, CORRECTIONS, OBJECTIVES, Registry, build_correction

# parameters for the factories that have required ones (every other correction builds with its defaults)
REQUIRED = {"importance": {"level": "geometric", "mode": "mask", "upper": 2.0}, "kl_rejection": {"mode": "seq_mean_k3",
                                                                                                  "upper": 0.1}}


def test_builtin_names():
    assert set(CORRECTIONS.names()) >= {"tis", "mis", "geo_mask", "icepop", "importance", "opsm", "veto", "trm",
                                        "ln_trm", "ser", "kl_rejection", "dvp_keep", "calibrated_is", "delight"}
    assert set(OBJECTIVES.names()) >= {"ppo", "decoupled", "bypass", "gspo", "reinforce", "cispo", "sapo", "dppo_tv",
                                       "dppo_kl", "calibrated_clip"}
    assert set(AGGREGATIONS.names()) >= {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum"}


def test_specs_build_what_the_factories_build():
    assert repr(build_correction("icepop")) == repr(op.icepop())
    assert repr(build_correction({"name": "opsm", "delta": 0.5})) == repr(op.opsm(delta=0.5))
    chained = build_correction([{"name": "tis", "upper": 3.0}, "veto"])
    assert repr(chained) == repr(op.chain(op.tis(upper=3.0), op.veto()))
    same = op.tis()
    assert build_correction(same) is same and build_correction(None) is None and build_correction([]) is None


@pytest.mark.parametrize(
    "spec, match",
    [
        ("tiss", r"unknown correction 'tiss'; registered: .*icepop.*tis"),
        ({"name": "opsm", "deltaa": 1.0}, r"correction 'opsm' has no parameter 'deltaa'; it takes: delta"),
        ({"delta": 1.0}, r"needs a 'name' key"),
        (3, r"a correction spec is a name or a mapping"),
        ({"name": "opsm", "delta": -1.0}, r"delta"),  # the factory's own validation
    ],
)
def test_bad_specs_fail_naming_what_is_wrong(spec, match):
    with pytest.raises(ValueError, match=match):
        build_correction(spec)


def test_a_taken_name_is_refused_but_the_same_function_may_register_again():
    registry: Registry = Registry("thing")

    def one():
        return 1

    def other():
        return 2

    registry.register("x", one)
    registry.register("x", one)  # a module imported again
    with pytest.raises(ValueError, match=r"thing 'x' is already registered"):
        registry.register("x", other)
    with pytest.raises(ValueError, match="non-empty string"):
        registry.register("", one)
    registry.unregister("x")
    assert "x" not in registry and len(registry) == 0


def test_an_unknown_objective_or_aggregation_fails_listing_the_registered_ones():
    batch = op.LogProbBatch(logp=torch.zeros(1, 2), mask=torch.ones(1, 2), advantages=torch.ones(1))
    with pytest.raises(ValueError, match=r"unknown objective 'ppo2'; registered: .*cispo.*ppo"):
        op.policy_loss(batch, objective="ppo2")
    with pytest.raises(ValueError, match=r"unknown aggregation 'mean'; registered: .*token_sum"):
        op.policy_loss(batch, aggregation="mean")


def test_a_registered_aggregation_is_usable_by_name():
    @op.register_aggregation("max_token")
    def max_token(token_loss, mask, max_tokens):
        return token_loss.amax()

    try:
        b = op.LogProbBatch(logp=torch.tensor([[-1.0, -3.0]]), mask=torch.ones(1, 2), advantages=torch.ones(1))
        loss, _ = op.policy_loss(b, objective="reinforce", aggregation="max_token")
        assert loss.item() == 3.0  # L = −A·log π = (1, 3)
    finally:
        AGGREGATIONS.unregister("max_token")


# -- every registered correction and objective ------------------------------------------------------------------------


def _build(name: str):
    return CORRECTIONS[name](**REQUIRED.get(name, {}))


# corrections that do not correct the mismatch and so are not the identity on policy: each must then not read μ at all
# (the delight gate weighs A × surprisal, arXiv 2603.20521)
INDEPENDENT_OF_MU = {"delight"}


@pytest.mark.parametrize("name", CORRECTIONS.names())
def test_every_registered_correction_is_the_identity_on_policy(name, random_batch):
    b = random_batch(seed=7, b=3, t=6, scale=0.0)  # π_θ = π_old = μ
    b = b.replace(rollout_logp=b.logp.clone(), old_logp=b.logp.clone())
    result = _build(name)(b)
    if name in INDEPENDENT_OF_MU:  # the same result with any μ, or none
        for other in (b.replace(rollout_logp=b.logp - 1.0), b.replace(rollout_logp=None)):
            again = _build(name)(other)
            assert torch.equal(again.weights, result.weights) and torch.equal(again.keep, result.keep), name
        assert torch.equal(result.keep, b.bool_mask) and all(torch.isfinite(v) for v in result.metrics.values())
        return
    assert torch.equal(result.keep, b.bool_mask) and torch.equal(result.weights, b.bool_mask.float()), name
    assert all(torch.isfinite(v) for v in result.metrics.values()), name


@pytest.mark.parametrize("name", OBJECTIVES.names())
def test_every_registered_objective_gives_a_finite_loss_and_gradient_zero_on_padding(name, random_batch):
    b = random_batch(seed=8, b=3, t=6, scale=0.3)
    junk = torch.where(b.bool_mask, b.logp, torch.tensor(float("nan")))
    logp = junk.clone().requires_grad_(True)
    loss, metrics = op.policy_loss(b.replace(logp=logp), objective=name)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), name
    assert torch.equal(grad[~b.bool_mask], torch.zeros_like(grad[~b.bool_mask])), name
    assert metrics["loss/nonfinite_tokens"].item() == 0.0 and all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("aggregation", AGGREGATIONS.names())
@pytest.mark.parametrize("name", OBJECTIVES.names())
def test_the_kept_gradient_is_autograds(name, aggregation, random_batch, monkeypatch):
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")  # non-finite μ on purpose: the paths past the limit
    # under torch.compile policy_loss takes the gradient in its forward (losses.with_gradient_kept; forced here in
    # eager mode): it must be the one loss.backward() gives on the same composition, with a correction's coefficient,
    # a NaN at padding and a dropped token
    import offpolicy.losses
    from offpolicy.losses import token_inputs

    monkeypatch.setattr(offpolicy.losses, "_keeps_gradient", lambda logp: logp.requires_grad)

    b = random_batch(seed=9, b=3, t=6, scale=0.3)
    logp0 = torch.where(b.bool_mask, b.logp, torch.tensor(float("nan")))
    rollout = b.rollout_logp.clone()
    rollout[0, 1] = float("inf")  # a token dropped as non-finite
    b = b.replace(rollout_logp=rollout)
    result = op.tis(upper=1.2)(b)
    logp = logp0.clone().requires_grad_(True)
    loss, metrics = op.policy_loss(b.replace(logp=logp), correction=result, objective=name, aggregation=aggregation)
    (kept,) = torch.autograd.grad(loss, logp)

    spec = OBJECTIVES[name]
    reference = logp0.clone().requires_grad_(True)
    inputs = token_inputs(b.replace(logp=reference), spec.inputs_read(True), corrected=True)
    token_loss = spec.fn(inputs).loss * result.coefficient * inputs.valid.float()
    expected_loss = AGGREGATIONS[aggregation](token_loss, b.bool_mask, None)
    (expected,) = torch.autograd.grad(expected_loss, reference)
    assert torch.equal(loss.detach(), expected_loss.detach()), (name, aggregation)
    torch.testing.assert_close(kept, expected, rtol=0, atol=0, msg=f"{name} / {aggregation}")


def test_without_a_gradient_the_loss_is_computed_once(random_batch):
    # no requires_grad (or no_grad): the plain forward, same numbers
    b = random_batch(seed=10, b=2, t=5)
    with_grad, _ = op.policy_loss(b.replace(logp=b.logp.clone().requires_grad_(True)))
    plain, _ = op.policy_loss(b)
    with torch.no_grad():
        no_grad, _ = op.policy_loss(b.replace(logp=b.logp.clone().requires_grad_(True)))
    assert with_grad.requires_grad and not plain.requires_grad and not no_grad.requires_grad
    assert torch.equal(with_grad.detach(), plain) and torch.equal(plain, no_grad)
