"""M2PO (arXiv 2510.01161, Algorithm 1): the batch-level second-moment mask, by hand, against a literal slow
transcription of the algorithm on random batches, against AReaL's selection, and its properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import chain
from offpolicy.corrections.importance import tis
from offpolicy.corrections.m2po import m2po, m2po_keep
from offpolicy.losses import policy_loss
from offpolicy.registry import build_correction


def slow_m2po(log_r: list[list[float]], mask: list[list[bool]], adv: list[float], tau: float,
              quadrants: bool = True) -> list[list[bool]]:
    """Algorithm 1 read literally: while the second moment of the kept valid tokens exceeds τ and a candidate is left,
    drop the candidate with the largest (log r)² (the first in row-major order on a tie)."""
    kept = {(i, t) for i, row in enumerate(mask) for t, m in enumerate(row) if m}

    def candidate(i: int, t: int) -> bool:
        if not quadrants:
            return True
        return (adv[i] > 0 and log_r[i][t] > 0) or (adv[i] < 0 and log_r[i][t] < 0)

    while kept:
        m2 = sum(log_r[i][t] ** 2 for i, t in kept) / len(kept)
        if m2 <= tau:
            break
        cands = [(i, t) for i, t in sorted(kept) if candidate(i, t)]
        if not cands:
            break
        worst = max(cands, key=lambda it: (log_r[it[0]][it[1]] ** 2, -it[0], -it[1]))
        kept.remove(worst)
    return [[(i, t) in kept for t in range(len(mask[0]))] for i in range(len(mask))]


def _batch(log_r, adv, mask=None, old=None):
    log_r = torch.tensor(log_r)
    m = torch.ones_like(log_r) if mask is None else torch.tensor(mask, dtype=torch.float32)
    return LogProbBatch(logp=torch.zeros_like(log_r), rollout_logp=-log_r, mask=m, advantages=torch.tensor(adv),
                        old_logp=old)


def test_by_hand():
    # log r = (0.5, −0.3, 0.2, −0.1 | 0.4, −0.6, 0.05, 0.0); A = (+1 | −1); τ = 0.04
    # (log r)² = (0.25, 0.09, 0.04, 0.01 | 0.16, 0.36, 0.0025, 0): Σ = 0.9125, N = 8, M2 = 0.1141 > τ
    # candidates: row 0 (A > 0) r > 1: 0.5, 0.2; row 1 (A < 0) r < 1: −0.6
    # drop 0.36 (−0.6): (0.9125 − 0.36)/7 = 0.0789 > τ; drop 0.25 (0.5): 0.3025/6 = 0.0504 > τ;
    # drop 0.04 (0.2): 0.2625/5 = 0.0525 > τ, but no candidate is left: stop with all three dropped
    r = m2po(threshold=0.04)(_batch([[0.5, -0.3, 0.2, -0.1], [0.4, -0.6, 0.05, 0.0]], [1.0, -1.0]))
    assert r.keep.tolist() == [[False, True, False, True], [True, False, True, True]]
    assert r.metrics["m2po/m2_before"].item() == pytest.approx(0.9125 / 8)
    assert r.metrics["m2po/m2_after"].item() == pytest.approx(0.2625 / 5)
    assert r.metrics["m2po/masked_frac"].item() == pytest.approx(3 / 8)
    assert r.metrics["m2po/kept_frac"].item() == pytest.approx(5 / 8) and r.metrics["m2po/capped_frac"].item() == 0
    assert r.metrics["m2po/candidate_frac"].item() == pytest.approx(3 / 8)
    assert r.weights.tolist() == [[1.0] * 4] * 2 and r.weight_level is None  # a pure mask
    # τ = 0.06: the second drop already gives 0.0504 ≤ 0.06
    r = m2po(threshold=0.06)(_batch([[0.5, -0.3, 0.2, -0.1], [0.4, -0.6, 0.05, 0.0]], [1.0, -1.0]))
    assert r.keep.tolist() == [[False, True, True, True], [True, False, True, True]]
    assert r.metrics["m2po/m2_after"].item() == pytest.approx(0.3025 / 6)


def test_areal_version_drops_any_token_and_reads_pi_old():
    # quadrants=False, source="mismatch": AReaL's get_m2po_loss_mask on (log π_prox − log μ)², π_prox = π_old here.
    # log π_old − log μ = (0.3, −0.2, 0.1); sorted (log r)² = 0.09, 0.04, 0.01; suffix means 0.0467, 0.025, 0.01;
    # AReaL masks up to the first suffix mean < τ = 0.03: index 1 → the 0.09 token dropped
    b = LogProbBatch(logp=torch.zeros(1, 3), old_logp=torch.tensor([[0.3, -0.2, 0.1]]), rollout_logp=torch.zeros(1, 3),
                     mask=torch.ones(1, 3), advantages=torch.tensor([-1.0]))
    assert m2po(threshold=0.03, quadrants=False, source="mismatch")(b).keep.tolist() == [[False, True, True]]
    # the paper's default reads π_θ (log r = 0 here): nothing to drop
    assert m2po(threshold=0.03)(b).keep.all()


def areal_mask(log_r: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """AReaL's selection, re-derived from its description: sort all valid (log r)² descending, mask the first k where
    k is the first index whose suffix mean is < τ (n − 1 when none is)."""
    m2 = log_r[mask] ** 2
    order = torch.argsort(m2, descending=True, stable=True)
    s = m2[order]
    suffix = s.flip(0).cumsum(0).flip(0) / torch.arange(len(s), 0, -1)
    below = torch.nonzero(suffix < tau)
    k = int(below[0]) if len(below) else len(s) - 1
    keep_sorted = torch.arange(len(s)) >= k
    keep = torch.zeros_like(mask)
    keep[mask] = keep_sorted[torch.argsort(order)]
    return keep


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 4), t=st.integers(1, 9), tau=st.sampled_from([0.0, 0.01, 0.04, 0.2]),
       scale=st.sampled_from([0.05, 0.3, 1.0]), quadrants=st.booleans(), ties=st.booleans())
def test_matches_the_literal_algorithm(seed, b, t, tau, scale, quadrants, ties):
    g = torch.Generator().manual_seed(seed)
    log_r = scale * torch.randn(b, t, generator=g)
    if ties:  # a coarse grid makes equal (log r)² common: the tie order must agree too
        log_r = (log_r * 4).round() / 4
    mask = torch.rand(b, t, generator=g) > 0.25
    adv = torch.randn(b, generator=g).round()  # some A = 0: never a candidate
    want = slow_m2po(log_r.tolist(), mask.tolist(), adv.tolist(), tau, quadrants)
    r = m2po(threshold=tau, quadrants=quadrants)(_batch(log_r.tolist(), adv.tolist(), mask.float().tolist()))
    assert r.keep.tolist() == want
    kept_m2 = [log_r[i, j].item() ** 2 for i in range(b) for j in range(t) if want[i][j]]
    after = sum(kept_m2) / len(kept_m2) if kept_m2 else 0.0
    assert r.metrics["m2po/m2_after"].item() == pytest.approx(after, abs=1e-6)
    if not quadrants and mask.any():
        # AReaL stops at a strictly-below suffix and keeps at least one token; where neither rule binds they agree
        areal = areal_mask(log_r, mask, tau)
        if areal.sum() > 1 and all(abs(v - tau) > 1e-6 for v in kept_m2 + [after]):
            assert r.keep.tolist() == areal.tolist()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), tau=st.sampled_from([0.0, 0.04, 1.0]))
def test_properties(seed, tau, random_batch):
    batch = random_batch(seed, 3, 7, scale=0.4)
    r = m2po(threshold=tau)(batch)
    valid = batch.bool_mask
    assert not (r.keep & ~valid).any()  # padding is never kept
    # the bound holds, or no candidate was left to drop (a non-candidate is never dropped)
    dropped = valid & ~r.keep
    assert r.metrics["m2po/m2_after"] <= tau + 1e-6 or r.metrics["m2po/candidate_frac"] == r.metrics["m2po/masked_frac"]
    log_r = (batch.logp - batch.rollout_logp).detach()
    a = batch.token_advantages()
    assert (((a > 0) & (log_r > 0)) | ((a < 0) & (log_r < 0)))[dropped].all()
    # on-policy (μ = π_θ): nothing is dropped
    on = batch.replace(rollout_logp=batch.logp.detach())
    assert torch.equal(m2po(threshold=tau)(on).keep, valid)
    # padding does not change the selection: a padded position with any log-prob is ignored
    noisy = batch.replace(rollout_logp=torch.where(valid, batch.rollout_logp, torch.full_like(batch.logp, 50.0)))
    assert torch.equal(m2po(threshold=tau)(noisy).keep, r.keep)


def test_threshold_zero_drops_every_candidate_and_large_keeps_all():
    b = _batch([[0.5, -0.5, 0.1]], [1.0])
    assert m2po(threshold=0.0)(b).keep.tolist() == [[False, True, False]]
    assert m2po(threshold=10.0)(b).keep.all()


def test_nonfinite_log_ratio_is_dropped_never_nan(monkeypatch):
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")  # non-finite μ on purpose: the paths past the limit
    b = LogProbBatch(logp=torch.zeros(1, 3), rollout_logp=torch.tensor([[0.0, float("nan"), -0.1]]),
                     mask=torch.ones(1, 3), advantages=torch.tensor([1.0]))
    r = m2po()(b)
    assert r.keep.tolist() == [[True, False, True]]
    assert all(math.isfinite(v.item()) for v in r.metrics.values())


def test_in_the_loss_the_denominator_keeps_dropped_tokens():
    # PPO on π_θ = π_old (r = 1): L = −A per kept token; the dropped token still counts in the token mean
    b = _batch([[1.0, 0.1, -0.1]], [1.0])
    logp = b.logp.clone().requires_grad_(True)
    b = b.replace(logp=logp, old_logp=torch.zeros(1, 3))
    loss, m = policy_loss(b, correction=m2po())
    assert loss.item() == pytest.approx(-2 / 3)  # (0 − 1 − 1) / 3: the log r = 1 token is dropped
    assert m["m2po/masked_frac"].item() == pytest.approx(1 / 3)


def test_by_name_chain_and_errors():
    assert repr(build_correction({"name": "m2po", "threshold": 0.1})) == "m2po(threshold=0.1, quadrants=True, source='total')"
    b = _batch([[0.5, -0.3]], [1.0])
    c = chain(tis(upper=2.0), m2po(threshold=0.0))
    assert c(b).keep.tolist() == (m2po(threshold=0.0)(b).keep & tis(upper=2.0)(b).keep).tolist()
    with pytest.raises(ValueError, match="threshold"):
        m2po(threshold=-1.0)
    with pytest.raises(ValueError, match="source"):
        m2po(source="behaviour")
    with pytest.raises(ValueError, match="quadrants"):
        m2po(quadrants="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rollout_logp"):
        m2po()(LogProbBatch(logp=torch.zeros(1, 2), mask=torch.ones(1, 2), advantages=torch.ones(1)))
    with pytest.raises(ValueError, match="advantages"):
        m2po()(LogProbBatch(logp=torch.zeros(1, 2), mask=torch.ones(1, 2), rollout_logp=torch.zeros(1, 2)))


def test_m2po_keep_empty_and_all_masked():
    keep, before, after = m2po_keep(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool),
                                    torch.zeros(2, 3, dtype=torch.bool), 0.04)
    assert not keep.any() and before.item() == 0.0 and after.item() == 0.0
    b = LogProbBatch(logp=torch.zeros(0, 3), rollout_logp=torch.zeros(0, 3), mask=torch.zeros(0, 3),
                     advantages=torch.zeros(0))
    assert m2po()(b).keep.shape == (0, 3)


def test_reachable_by_name_from_trl_and_verl_helpers():
    # TRL: vLLM's sampling_per_token_logps is μ; verl: the driver-side rollout_correction (π_θ = π_old there)
    from offpolicy.integrations.trl import trl_policy_loss
    from offpolicy.integrations.verl import rollout_correction

    lp = torch.zeros(1, 3, requires_grad=True)
    inputs = {"completion_mask": torch.ones(1, 3), "advantages": torch.tensor([1.0]),
              "sampling_per_token_logps": torch.tensor([[-1.0, -0.1, 0.1]])}
    loss, m = trl_policy_loss(lp, inputs, correction="m2po")
    assert m["m2po/masked_frac"].item() == pytest.approx(1 / 3)  # the log r = 1 token (module docstring's example)
    assert loss.item() == pytest.approx(-2 / 3)
    _, keep, metrics = rollout_correction(torch.zeros(1, 3), torch.tensor([[-1.0, -0.1, 0.1]]), torch.ones(1, 3),
                                          "m2po", advantages=torch.tensor([1.0]))
    assert keep.tolist() == [[False, True, True]] and any(k.endswith("m2po/m2_after") for k in metrics)
