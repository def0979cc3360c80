"""The methods published since September in the verl plug-in, at unit level: the settings block accepts calibrated IS
(arXiv 2609.32444) and the delight gate (arXiv 2603.20521) by name and refuses their bad parameters naming the path,
and calibrated clipping (arXiv 2609.22870) is the plug-in's policy loss ``offpolicy_calibrated_clip``: PPO without
the engine's μ, the calibrated range with it. (A full verl run is not part of these tests.)"""

from __future__ import annotations

import pytest
import torch

from offpolicy.integrations.verl.hosts import plugin_policy_losses
from offpolicy.integrations.verl.loss import rollout_log_probs_in_loss, verl_policy_loss_fn
from offpolicy.integrations.verl.settings import parse_settings
from offpolicy.registry import build_correction


def test_the_settings_accept_the_new_corrections_by_name():
    spec = [{"name": "calibrated_is", "lam": 0.5}, {"name": "delight", "temperature": 2.0, "policy": "current"}]
    settings = parse_settings({"correction": spec})
    assert repr(build_correction(settings.correction)) == ("chain(calibrated_is(lam=0.5, kappa=0.005, source='mismatch'), "
                                                           "delight(temperature=2.0, policy='current'))")


@pytest.mark.parametrize("spec, path", [
    ({"name": "calibrated_is", "lam": -1.0}, "correction.lam"),
    ({"name": "calibrated_is", "kappa": "small"}, "correction.kappa"),
    ([{"name": "tis"}, {"name": "delight", "policy": "mu"}], r"correction\[1\].policy"),
    ({"name": "delight", "temperature": 0.0}, "correction.temperature"),
])
def test_bad_parameters_are_refused_naming_their_path(spec, path):
    with pytest.raises(ValueError, match=rf"^OFFPOLICY_VERL: {path}"):
        parse_settings({"correction": spec})


def test_calibrated_clip_is_a_plugin_policy_loss_ppo_without_mu_calibrated_with_it():
    assert plugin_policy_losses()["offpolicy_calibrated_clip"] == {"objective": "calibrated_clip"}
    config = {"clip_ratio": 0.2}
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)

    def run(objective, mu=None):
        logp = old.clone().requires_grad_(True)
        with rollout_log_probs_in_loss(mu):
            loss, _ = verl_policy_loss_fn(objective=objective)(old, logp, adv, mask, "token-mean", config)
        return loss, torch.autograd.grad(loss, logp)[0]

    # no μ (verl's policy-loss call without the plug-in's engine): PPO exactly
    ours, ppo = run("calibrated_clip"), run("ppo")
    assert torch.equal(ours[0].detach(), ppo[0].detach()) and torch.equal(ours[1], ppo[1])
    # with μ: ρ = π_old/μ = (0.7, 0.75, 1, 1.3) at quantile 0 widens [0.8, 1.2] to [0.7, 1.3], so the A < 0 token at
    # 0.75 keeps its gradient (tests/objectives/test_calibrated_clip.py works the numbers out by hand)
    mu = old - torch.log(torch.tensor([[0.7, 0.75, 1.0, 1.3]]))
    loss, grad = run({"name": "calibrated_clip", "quantile": 0.0}, mu)
    assert loss.item() == pytest.approx(0.0875, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.175, 0.1875, -0.25, 0.325]]))


def test_the_driver_applies_them_after_verls_advantages():
    from offpolicy.integrations.verl import apply_driver_correction

    # π_old = (0.5, 0.5, 0.999), μ = (0.2, 0.5, 0.9), A = (+1, −1, +1)
    b = {"old_log_probs": torch.log(torch.tensor([[0.5, 0.5, 0.999]])),
         "rollout_log_probs": torch.log(torch.tensor([[0.2, 0.5, 0.9]])),
         "response_mask": torch.ones(1, 3), "advantages": torch.tensor([[1.0, -1.0, 1.0]])}
    # calibrated IS: ρ = (2.5, 1, 1.11), caps (1.5, 1.5, 1.005)
    up, metrics = apply_driver_correction(b, parse_settings({"correction": "calibrated_is"}))
    torch.testing.assert_close(up["rollout_is_weights"], torch.tensor([[1.5, 1.0, 1.005]]))
    assert metrics["rollout_corr/calibrated_is/capped_frac"] == pytest.approx(2 / 3)
    # the delight gate: σ(A·(−log π_old)) = (σ(ln 2), σ(−ln 2), σ(−ln 0.999)) = (2/3, 1/3, ≈ ½)
    up, metrics = apply_driver_correction(b, parse_settings({"correction": "delight"}))
    torch.testing.assert_close(up["rollout_is_weights"],
                               torch.tensor([[2 / 3, 1 / 3, 1 / (1 + 0.999)]]))
    assert metrics["rollout_corr/delight/suppressed_frac"] == pytest.approx(1 / 3)
    assert up["response_mask"].tolist() == [[1.0, 1.0, 1.0]]
