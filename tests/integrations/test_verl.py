"""verl adapter: signature, config mapping, verl's metric names, hand-computed numbers."""

import math

import pytest
import torch

from offpolicy.corrections.importance import icepop, tis
from offpolicy.integrations.verl import rollout_correction, verl_policy_loss_fn


def test_ppo_clip_and_dual_clip_hand_computed():
    # Two tokens, A = -1 on both. old = 0, logp = (log 2, log 0.5).
    # token 1: r = 2, A<0: PPO term -min(2·-1, clip(2,0.8,1.2)·-1) = -min(-2, -1.2) = 2; dual clip c=3 bounds at 3 -> 2.
    # token 2: r = 0.5: -min(-0.5, -0.8) = 0.8.
    # token-mean = (2 + 0.8) / 2 = 1.4
    fn = verl_policy_loss_fn()
    logp = torch.tensor([[math.log(2.0), math.log(0.5)]], requires_grad=True)
    loss, metrics = fn(torch.zeros(1, 2), logp, -torch.ones(1, 2), torch.ones(1, 2), "token-mean",
                       {"clip_ratio": 0.2, "clip_ratio_c": 3.0})
    assert loss.item() == pytest.approx(1.4, abs=1e-6)
    # ppo_kl = mean(old - logp) = (−log 2 + log 2)/2 = 0
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    # token 1 is clipped (r > 1.2 with A<0 is not in the clipped region for PPO-min; token 2 r<0.8, A<0 is clipped low)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)


def test_dual_clip_binds():
    # r = e^2 ≈ 7.389, A = -1: PPO term = 7.389; c = 3 bounds it at 3·|A| = 3.
    fn = verl_policy_loss_fn()
    loss, metrics = fn(torch.zeros(1, 1), torch.full((1, 1), 2.0, requires_grad=True), -torch.ones(1, 1),
                       torch.ones(1, 1), "token-mean", {"clip_ratio": 0.2, "clip_ratio_c": 3.0})
    assert loss.item() == pytest.approx(3.0, abs=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1.0)
    assert all(type(v) is float for v in metrics.values())  # as verl's own losses (its driver averages with numpy)


def test_verls_metrics_beyond_e20_by_hand():
    # old = 0; logp = (−25, 25, 0.5, −0.5); A = (1, −1, 1, −1); ε = 0.2, c = 1.1. verl clamps log r to ±20 first:
    # ppo_kl = −mean(−20, 20, 0.5, −0.5) = 0 (unclamped it would be 0 as well: check the fractions instead)
    # pg_clipfrac: token 0 (A > 0, r = e^−20 < 0.8) is not clipped for its sign; token 1 (A < 0, r = e^20) neither;
    #   token 2 (A > 0, r = 1.65 > 1.2) and token 3 (A < 0, r = 0.61 < 0.8) are → 2/4
    # pg_clipfrac_lower: A < 0 and max(r, clip r) > 1.1: token 1 (e^20) only → 1/4
    # offpolicy's own clipfrac_low / _high also count token 0 (no gradient below e^−20): 3/4, not verl's
    fn = verl_policy_loss_fn()
    logp = torch.tensor([[-25.0, 25.0, 0.5, -0.5]], requires_grad=True)
    _, metrics = fn(torch.zeros(1, 4), logp, torch.tensor([[1.0, -1.0, 1.0, -1.0]]), torch.ones(1, 4), "token-sum",
                    {"clip_ratio": 0.2, "clip_ratio_c": 1.1})
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.25)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    # offpolicy's "held" tokens: 0 (below e^−20), 2 (high), 3 (low); token 1 is the dual clip's
    assert metrics["loss/clipfrac_low"] + metrics["loss/clipfrac_high"] == pytest.approx(0.75)
    _, shifted = fn(torch.zeros(1, 2), torch.tensor([[-30.0, -1.0]]), torch.ones(1, 2), torch.ones(1, 2))
    assert shifted["actor/ppo_kl"] == pytest.approx((20.0 + 1.0) / 2)  # clamped at 20, not (30 + 1)/2


@pytest.mark.parametrize("clip", [(0.2, 0.2, 3.0), (0.2, 0.28, 1.1), (0.1, 0.3, 1.5)])
def test_ppo_metrics_equal_verls_vanilla_on_large_log_ratios(clip):
    # verl's own compute_policy_loss_vanilla on the same tensors, log r up to ±50 (beyond its ±20 clamp), A of
    # both signs and some zeros, a ragged mask
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from omegaconf import OmegaConf

    low, high, c = clip
    g = torch.Generator().manual_seed(11)
    old = -torch.rand(6, 9, generator=g) * 3
    logp = old + 100 * (torch.rand(6, 9, generator=g) - 0.5) * (torch.rand(6, 9, generator=g) > 0.5)
    advantages = torch.randn(6, 9, generator=g) * (torch.rand(6, 9, generator=g) > 0.2)
    mask = (torch.arange(9)[None] < torch.tensor([9, 3, 7, 1, 9, 5])[:, None]).float()
    config = OmegaConf.create({"clip_ratio": low, "clip_ratio_low": low, "clip_ratio_high": high,
                               "clip_ratio_c": c, "global_batch_info": {}})
    _, theirs = core_algos.compute_policy_loss_vanilla(old, logp, advantages, mask, "token-mean", config)
    _, ours = verl_policy_loss_fn()(old, logp, advantages, mask, "token-mean", config)
    assert ((logp - old).abs() * mask).max() > 20  # the case the clamp decides
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-7), key


def test_rollout_is_weights_multiply_and_legacy_tuple():
    # on-policy (r = 1), A = 1, weights (2, 0.5): token-mean of -(w·A) = -(2 + 0.5)/2 = -1.25
    fn = verl_policy_loss_fn(legacy_tuple=True)
    out = fn(torch.zeros(1, 2), torch.zeros(1, 2, requires_grad=True), torch.ones(1, 2), torch.ones(1, 2),
             "token-mean", None, torch.tensor([[2.0, 0.5]]))
    assert len(out) == 4
    assert out[0].item() == pytest.approx(-1.25)


# On-policy, A = 1: L_t = −1 on the 3 valid tokens of mask ((1, 1), (1, 0), (0, 0)): B = 3 rows, S = 2 with a token,
# T = 2. The newer worker path's global counts: D = dp_size 2, N = 6 tokens, G = 4 sequences, F = loss_scale_factor 10.
GLOBAL = {"dp_size": 2, "batch_num_tokens": 6, "global_batch_size": 4, "loss_scale_factor": 10}


@pytest.mark.parametrize(
    "version, mode, info, expected",
    [
        # verl 0.9.1's agg_loss (core_algos.py), no global_batch_info (the legacy worker path):
        ("0.9.1", "token-mean", {}, -3 / 3),  # Σ / tokens
        ("0.9.1", "token-sum", {}, -3.0),  # Σ
        ("0.9.1", "seq-mean-token-mean", {}, (-1 - 1) / 2),  # token means (−1, −1) over S = 2 sequences
        ("0.9.1", "seq-mean-token-sum", {}, (-2 - 1) / 2),  # token sums (−2, −1) over S = 2
        ("0.9.1", "seq-mean-token-sum-norm", {}, (-2 - 1) / 2 / 2),  # token sums over S, then / T = 2
        # ... with the global counts
        ("0.9.1", "token-mean", GLOBAL, -3 / 6 * 2),  # Σ / N · D
        ("0.9.1", "token-sum", GLOBAL, -3 * 2),  # Σ · D
        ("0.9.1", "seq-mean-token-mean", GLOBAL, -2 / 4 * 2),  # Σ means / G · D
        ("0.9.1", "seq-mean-token-sum", GLOBAL, -3 / 4 * 2),  # Σ / G · D
        ("0.9.1", "seq-mean-token-sum-norm", GLOBAL, -3 / 4 * 2 / 10),  # Σ / G · D / F
        # 0.7.0: seq-mean-token-sum-norm divides by F (default T) only — no sequence count, no D
        ("0.7.0", "seq-mean-token-sum-norm", {}, -3 / 2),
        ("0.7.0", "seq-mean-token-sum-norm", GLOBAL, -3 / 10),
        ("0.7.0", "seq-mean-token-sum", GLOBAL, -3 / 4 * 2),
        # 0.6.1: no global counts; sequence means over the S = 2 rows with a token
        ("0.6.1", "seq-mean-token-mean", {}, -2 / 2),
        ("0.6.1", "seq-mean-token-sum-norm", {}, -3 / 2),
        # 0.5.0: torch.mean over all B = 3 rows, the empty one included
        ("0.5.0", "seq-mean-token-sum", {}, -3 / 3),
        ("0.5.0", "seq-mean-token-mean", {}, -2 / 3),
        ("0.5.0", "token-mean", {}, -3 / 3),
    ],
)
def test_every_loss_agg_mode_is_verls_agg_loss(version, mode, info, expected):
    fn = verl_policy_loss_fn(verl_version=version)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    logp = torch.zeros(3, 2, requires_grad=True)
    loss, _ = fn(torch.zeros(3, 2), logp, torch.ones(3, 2), mask, mode, {"global_batch_info": info})
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # d/dlogp of the same aggregate of −r: −(aggregation weight) per valid token, so the gradient sums to the loss
    assert logp.grad.sum().item() == pytest.approx(expected, rel=1e-6)
    assert logp.grad[1, 1].item() == 0.0 and logp.grad[2].abs().sum().item() == 0.0


def test_default_rules_are_the_installed_verls_or_the_newest(monkeypatch):
    import importlib.metadata

    from offpolicy.integrations.verl import loss as adapter

    mask = torch.ones(4, 2)
    args = (torch.zeros(4, 2), torch.zeros(4, 2), torch.ones(4, 2), mask, "seq-mean-token-sum-norm")

    def installed(version):
        def fake(name):
            if version is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return version
        monkeypatch.setattr(adapter.importlib.metadata, "version", fake)
        return adapter.verl_policy_loss_fn()(*args)[0].item()

    # 8 tokens of L = −1, B = 4, T = 2: since 0.7.1 −8 / 4 / 2 = −1; before, −8 / 2 = −4 (B× larger)
    assert installed("0.7.1") == pytest.approx(-1.0)
    assert installed("0.6.1") == pytest.approx(-4.0)
    assert installed(None) == pytest.approx(-1.0)  # not installed: the newest rules
    with pytest.raises(ValueError, match="verl_version"):
        verl_policy_loss_fn(verl_version="main")


def test_bad_loss_agg_mode_is_named():
    fn = verl_policy_loss_fn()
    with pytest.raises(ValueError, match="loss_agg_mode"):
        fn(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), "token_sum")


def test_rollout_correction_matches_correction_and_prefixes_metrics():
    # old = 0, rollout = (0, -2, 1): ρ = π_old/μ = (1, e^2, e^-1); icepop keeps [0.5, 5]: e^2 = 7.39 dropped, e^-1 = 0.37 dropped
    w, keep, metrics = rollout_correction(torch.zeros(1, 3), torch.tensor([[0.0, -2.0, 1.0]]), torch.ones(1, 3), icepop())
    assert keep.tolist() == [[True, False, False]]
    assert w[0, 0].item() == pytest.approx(1.0)
    assert all(k.startswith("rollout_corr/") for k in metrics)
    # tis caps e^2 at 2
    w, keep, _ = rollout_correction(torch.zeros(1, 3), torch.tensor([[0.0, -2.0, 1.0]]), torch.ones(1, 3), tis(upper=2.0))
    assert w[0].tolist() == pytest.approx([1.0, 2.0, math.exp(-1.0)])
    # registered names work as the objects do; an unknown one is named with the registered ones
    by_name = rollout_correction(torch.zeros(1, 3), torch.tensor([[0.0, -2.0, 1.0]]), torch.ones(1, 3),
                                 [{"name": "tis", "upper": 2.0}])
    assert torch.equal(by_name[0], w)
    with pytest.raises(ValueError, match="unknown correction 'tiss'"):
        rollout_correction(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "tiss")
    with pytest.raises(ValueError, match="correction"):
        rollout_correction(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), 3.0)
