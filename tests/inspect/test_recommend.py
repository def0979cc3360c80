"""Recommended thresholds: the stated fraction is what the correction keeps when applied with that threshold."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offpolicy as op
from offpolicy.inspect.measurements import TokenData
from offpolicy.inspect.recommend import (
    preset_effects,
    recommend_mis,
    recommend_opsm,
    recommend_trm,
    recommend_veto,
)


def _tokens(trainer, rollout, mask=None, kl=None, advantages=None) -> TokenData:
    trainer, rollout = torch.as_tensor(trainer, dtype=torch.float32), torch.as_tensor(rollout, dtype=torch.float32)
    mask = torch.ones_like(trainer, dtype=torch.bool) if mask is None else torch.as_tensor(mask, dtype=torch.bool)
    return TokenData(completion_ids=torch.zeros_like(trainer, dtype=torch.long), mask=mask, rollout_logp=rollout,
                     trainer_logp=trainer, kl=None if kl is None else torch.as_tensor(kl, dtype=torch.float32),
                     kl_kind=None if kl is None else "exact", advantages=advantages)


def test_trm_by_hand():
    # per-sequence max KL 0.1, 0.2, 0.3, 0.4: ≥ 70 % of 4 = 2.8 → 3 sequences → δ = 0.3 (nudged up by 1e-6 relative),
    # accepting 3/4 = 75 %; means (0.1+0)/2, (0.2+0)/2, … = 0.05, 0.1, 0.15, 0.2 → avg δ = 0.15
    kl = [[0.1, 0.0], [0.2, 0.0], [0.3, 0.0], [0.0, 0.4]]
    t = _tokens(torch.zeros(4, 2), torch.zeros(4, 2), kl=kl)
    r = recommend_trm(t, "max")
    assert r["max_kl"] == pytest.approx(0.3, rel=2e-6) and r["kept_fraction"] == 0.75
    a = recommend_trm(t, "avg")
    assert a["avg_kl"] == pytest.approx(0.15, rel=2e-6) and a["kept_fraction"] == 0.75


def test_trm_without_kl_uses_k2_k3():
    # r = log π − log μ = (0.1, −0.2, 0.3): k2 = ½ r² = (0.005, 0.02, 0.045), one token per sequence
    t = _tokens([[0.1], [-0.2], [0.3]], [[0.0], [0.0], [0.0]])
    r = recommend_trm(t, "max")  # 70 % of 3 = 2.1 → 3rd smallest max k2 = 0.045
    assert r["divergence"] == "k2/k3 of the sampled token" and r["max_kl"] == pytest.approx(0.045, rel=1e-5)
    assert r["kept_fraction"] == 1.0


def test_mis_band_by_hand():
    # 40 tokens with r = log π − log μ = −0.39, −0.38, …, 0.0 (i/100 for i = −39 … 0): 5 % of 40 = 2 → 1 per tail:
    # k = floor(0.025 · 40) = 1 → lower at the 2nd smallest (−0.38), upper at the 2nd largest (−0.01 → 0, the band holds 1)
    r = torch.arange(-39, 1, dtype=torch.float32)[None, :] / 100
    t = _tokens(r, torch.zeros_like(r))
    m = recommend_mis(t)
    assert m["lower"] == pytest.approx(math.exp(-0.38), rel=2e-6) and m["upper"] == pytest.approx(1.0, abs=1e-6)
    assert m["kept_fraction"] == pytest.approx(39 / 40)  # only −0.39 is masked


def test_opsm_and_veto_by_hand():
    # mean log μ − log π per sequence: 0.0, 0.1, 0.2, …, 1.9 (20 sequences); ≥ 95 % kept → 19th smallest = 1.8
    r = -torch.arange(20, dtype=torch.float32)[:, None] / 10 * torch.ones(1, 3)
    t = _tokens(r, torch.zeros_like(r))
    o = recommend_opsm(t)
    assert o["delta"] == pytest.approx(1.8, rel=2e-6) and o["kept_fraction"] == 0.95
    # with advantages, only A < 0 sequences count: the positive ones are never masked
    adv = torch.tensor([1.0] * 10 + [-1.0] * 10)
    o = recommend_opsm(_tokens(r, torch.zeros_like(r), advantages=adv))
    assert o["kept_fraction"] >= 0.95 and "A < 0" in o["unit"]
    # veto: min r per sequence 0, −0.1, …, −1.9: keep ≥ 99 % of 20 → floor(0.01·20) = 0 below → τ = e^{−1.9}
    v = recommend_veto(t)
    assert v["threshold"] == pytest.approx(math.exp(-1.9), rel=1e-5) and v["kept_fraction"] == 1.0


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 12), st.integers(1, 10), st.floats(0.0, 3.0), st.integers(0, 2**16))
def test_reapplied_with_the_presets_they_keep_what_they_state(b, t_len, scale, seed):
    """Every recommendation meets its target, and the published correction built with that threshold keeps exactly the
    stated fraction (applied again here through the presets, not the recommender's own check)."""
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(b, t_len, generator=g) * 5
    rollout = trainer + scale * torch.randn(b, t_len, generator=g)
    mask = torch.rand(b, t_len, generator=g) < 0.8
    mask[:, 0] = True
    kl = (scale * torch.rand(b, t_len, generator=g)) ** 2
    t = _tokens(trainer, rollout, mask, kl=torch.where(mask, kl, 0.0))
    batch = op.LogProbBatch(logp=t.trainer_logp, old_logp=t.trainer_logp, rollout_logp=t.rollout_logp, mask=mask,
                            advantages=-torch.ones(b), token_divergence=t.kl)
    rows = mask.any(-1)

    def seq_kept(result) -> float:
        return float((result.keep.any(-1) & rows).sum()) / float(rows.sum())

    r = recommend_trm(t, "max")
    assert r["kept_fraction"] >= 0.7 and seq_kept(op.trm(max_kl=r["max_kl"], avg_kl=None)(batch)) == r["kept_fraction"]
    r = recommend_trm(t, "avg")
    assert r["kept_fraction"] >= 0.7 and seq_kept(op.trm(max_kl=None, avg_kl=r["avg_kl"])(batch)) == r["kept_fraction"]
    r = recommend_mis(t)
    keep = op.mis(lower=r["lower"], upper=r["upper"])(batch).keep
    assert r["kept_fraction"] >= 0.95 and float(keep[mask].double().mean()) == pytest.approx(r["kept_fraction"])
    r = recommend_opsm(t)
    assert r["kept_fraction"] >= 0.95 and seq_kept(op.opsm(delta=r["delta"])(batch)) == r["kept_fraction"]
    r = recommend_veto(t)
    assert r["kept_fraction"] >= 0.99 and seq_kept(op.veto(threshold=r["threshold"])(batch)) == r["kept_fraction"]


def test_on_policy_keeps_everything():
    """μ = π: every threshold keeps all, and every correction at its defaults masks nothing."""
    lp = -torch.rand(5, 7)
    t = _tokens(lp, lp.clone(), kl=torch.zeros(5, 7))
    for r in (recommend_trm(t, "max"), recommend_trm(t, "avg"), recommend_mis(t), recommend_opsm(t),
              recommend_veto(t)):
        assert r["kept_fraction"] == 1.0
    for row in preset_effects(t):
        assert row["masked_tokens"] == 0.0 and row["dropped_sequences"] == 0.0 and row["truncated_tokens"] == 0.0


def test_preset_effects_by_hand():
    # one sequence, r = log π − log μ = (0, −1): ρ = (1, 0.368). icepop [0.5, 5] masks token 2 (½ of the tokens);
    # tis caps at 2, nothing above → nothing truncated; veto 1e-4: e^−1 > 1e-4 keeps; opsm: mean log μ − log π = 0.5
    # > 1e-4 with A < 0 → the sequence is dropped; trm with KL (0.01, 0.06): max 0.06 > 0.05 → dropped.
    t = _tokens([[-1.0, -2.0]], [[-1.0, -1.0]], kl=[[0.01, 0.06]])
    rows = {r["preset"]: r for r in preset_effects(t)}
    assert rows["icepop"]["masked_tokens"] == 0.5 and rows["icepop"]["dropped_sequences"] == 0.0
    assert rows["tis"]["masked_tokens"] == 0.0 and rows["tis"]["truncated_tokens"] == 0.0
    assert rows["veto"]["masked_tokens"] == 0.0
    assert rows["opsm"]["masked_tokens"] == 1.0 and rows["opsm"]["dropped_sequences"] == 1.0
    assert rows["trm"]["dropped_sequences"] == 1.0
