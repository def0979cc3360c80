"""The one vocabulary every correction logs for what it drops or caps (``offpolicy.corrections.base.drop_metrics``):
``<name>/kept_frac``, ``/masked_frac``, ``/capped_frac`` per valid token and ``/masked_seq_frac`` per non-empty
sequence — hand-computed for TIS (capped), MIS (masked), IcePop (masked on both sides), the token veto, OPSM and TRM
(whole sequences masked), and as properties over every registered correction: on policy everything is kept, the three
token shares sum to 1, and padding never counts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offpolicy as op
from offpolicy.corrections.base import DROP_NAMES, Correction, CorrectionResult, drop_metrics
from offpolicy.registry import CORRECTIONS, build_correction

E = math.e
REQUIRED = {
    "importance": {"level": "token", "mode": "truncate", "upper": 2.0},
    "kl_rejection": {"mode": "seq_max_k2", "upper": 0.1},
}


def shares(result: CorrectionResult, name: str) -> tuple[float, float, float, float]:
    """(kept, masked, capped, masked_seq) of ``result`` under ``name``, rounded to 6 digits."""
    return tuple(round(result.metrics[f"{name}/{k}"].item(), 6) for k in DROP_NAMES)  # type: ignore[return-value]


def batch(log_ratio, mask=None, advantages=None) -> op.LogProbBatch:
    """π_θ = π_old = 0 and μ = −log ρ, so log(π_old/μ) = ``log_ratio``."""
    r = torch.tensor(log_ratio, dtype=torch.float32)
    m = torch.ones_like(r) if mask is None else torch.tensor(mask, dtype=torch.float32)
    a = None if advantages is None else torch.tensor(advantages, dtype=torch.float32)
    return op.LogProbBatch(
        logp=torch.zeros_like(r), old_logp=torch.zeros_like(r), rollout_logp=-r, mask=m, advantages=a
    )


# ---------------------------------------------------------------------------------------------------------------------
# By hand
# ---------------------------------------------------------------------------------------------------------------------


def test_tis_caps_and_never_masks():
    # ρ = (1, e, 1/e, e²) and a padded 9; cap 2: e and e² are truncated, 1 and 1/e untouched
    r = op.tis(upper=2.0)(batch([[0.0, 1.0, -1.0, 2.0, 9.0]], [[1, 1, 1, 1, 0]]))
    assert shares(r, "tis") == (0.5, 0.0, 0.5, 0.0)
    # a lower bound truncates from below too: clamp(ρ, 0.5, 2) moves 1/e = 0.368 as well
    assert shares(op.tis(upper=2.0, lower=0.5)(batch([[0.0, 1.0, -1.0, 2.0]])), "tis") == (0.25, 0.0, 0.75, 0.0)


def test_tis_at_sequence_level_caps_every_token_of_a_capped_sequence():
    # row sums of log ρ: 0.5 + 0.5 = 1 → ρ = e > 2 capped (2 tokens); 0.1 → 1.105 kept (3 tokens)
    r = op.tis(upper=2.0, level="sequence")(batch([[0.5, 0.5, 0.0], [0.1, 0.0, 0.0]], [[1, 1, 0], [1, 1, 1]]))
    assert shares(r, "tis") == (0.6, 0.0, 0.4, 0.0)


def test_mis_masks_and_never_caps():
    # ρ = (1, e, 1/e, e²) in [0, 2]: e and e² dropped; 1/e kept with its own weight (no lower bound)
    r = op.mis(upper=2.0)(batch([[0.0, 1.0, -1.0, 2.0]]))
    assert shares(r, "mis") == (0.5, 0.5, 0.0, 0.0)
    # at the geometric level the whole sequence goes: row means 0.75 → e^0.75 = 2.1 > 2 dropped; 0 kept
    r = op.mis(upper=2.0, level="geometric")(batch([[0.5, 1.0], [0.0, 0.0]]))
    assert shares(r, "mis") == (0.5, 0.5, 0.0, 0.5)


def test_icepop_masks_on_both_sides():
    # ρ = (1, e, 1/e, e², e⁻²) in [0.5, 5]: 1 and e kept; 1/e = 0.37 below, e² = 7.4 above, e⁻² = 0.14 below
    r = op.icepop()(batch([[0.0, 1.0, -1.0, 2.0, -2.0]]))
    assert r.keep.tolist() == [[True, True, False, False, False]]
    assert shares(r, "icepop") == (0.4, 0.6, 0.0, 0.0)


def test_token_veto_masks_whole_sequences():
    # row 0: ρ = e^−12 = 6e-6 < 1e-4 vetoes its 3 tokens; row 1 (2 tokens) fine; row 2 empty (no token, no sequence)
    r = op.veto()(batch([[0.0, -12.0, 0.0], [0.1, 0.1, 0.0], [-99.0, 0.0, 0.0]], [[1, 1, 1], [1, 1, 0], [0, 0, 0]]))
    assert shares(r, "veto") == (0.4, 0.6, 0.0, 0.5)


def test_opsm_masks_negative_sequences_that_drifted():
    # log μ − log π_θ per sequence = −mean log ρ: rows (−1, −1) → 1 > δ = 0.5 with A < 0 dropped (2 tokens);
    # the same row with A > 0 kept; row 2 (3 tokens) at 0 kept
    r = op.opsm(delta=0.5)(
        batch(
            [[-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]],
            [[1, 1, 0], [1, 1, 0], [1, 1, 1]],
            advantages=[-1.0, 1.0, -1.0],
        )
    )
    assert shares(r, "opsm") == (round(5 / 7, 6), round(2 / 7, 6), 0.0, round(1 / 3, 6))


def test_trm_masks_sequences_and_the_acceptance_rate_is_one_minus_masked_seq_frac():
    # the k2 max test on r = log(π_θ/μ): row maxima ½·0.1² = 0.005 ≤ 0.05 kept (1 token), ½·0.5² = 0.125 dropped
    # (3 tokens)
    b = batch([[0.1, 0.0, 0.0], [0.5, 0.1, 0.1]], [[1, 0, 0], [1, 1, 1]])
    r = op.trm(max_kl=0.05, avg_kl=None)(b)
    assert shares(r, "trm") == (0.25, 0.75, 0.0, 0.5)
    accepted = r.keep.any(-1).float().mean().item()
    assert 1.0 - r.metrics["trm/masked_seq_frac"].item() == accepted == 0.5


def test_a_chain_answers_for_the_whole_and_each_part_for_itself():
    # ρ = (1, e, 1/e): tis(2) caps e; icepop drops 1/e → the chain keeps 1, caps e, masks 1/e
    r = op.chain(op.tis(upper=2.0), op.icepop())(batch([[0.0, 1.0, -1.0]]))
    third = round(1 / 3, 6)
    assert shares(r, "chain") == (third, third, third, 0.0)
    assert shares(r, "tis") == (round(2 / 3, 6), 0.0, third, 0.0)
    assert shares(r, "icepop") == (round(2 / 3, 6), third, 0.0, 0.0)


def test_the_helper_by_hand_and_its_empty_batch():
    # coefficient = weights · keep: (1, 2, 0 | 0, 0, pad); capped marks the 2; row 1 has no live token
    r = CorrectionResult(
        torch.tensor([[1.0, 2.0, 3.0], [1.0, 0.0, 7.0]]),
        torch.tensor([[True, True, False], [False, True, True]]),
        capped=torch.tensor([[False, True, True], [False, False, True]]),
    )
    m = drop_metrics("c", r, torch.tensor([[1, 1, 1], [1, 1, 0]]))
    # valid 5: kept 1 (the 1.0), capped 1 (the 2.0: the 3.0 is capped but dropped, the 7.0 padding), masked 3
    assert {k: round(v.item(), 6) for k, v in m.items()} == {
        "c/kept_frac": 0.2,
        "c/masked_frac": 0.6,
        "c/capped_frac": 0.2,
        "c/masked_seq_frac": 0.5,
    }
    empty = op.LogProbBatch(logp=torch.zeros(0, 3), rollout_logp=torch.zeros(0, 3), mask=torch.zeros(0, 3))
    assert shares(op.tis()(empty), "tis") == (1.0, 0.0, 0.0, 0.0)  # the on-policy values, never NaN
    none_valid = batch([[5.0, -5.0]], [[0, 0]])
    assert shares(op.mis()(none_valid), "mis") == (1.0, 0.0, 0.0, 0.0)


def test_a_function_of_your_own_gets_the_names_and_a_host_factor_can_opt_out():
    halve = Correction("halve", lambda b: CorrectionResult(0.5 * b.bool_mask.float(), b.bool_mask, {}))
    assert shares(halve(batch([[0.0, 3.0]])), "halve") == (1.0, 0.0, 0.0, 0.0)  # reweighted, not capped: kept
    quiet = Correction("host", lambda b: CorrectionResult.identity(b), logs_drops=False)
    assert quiet(batch([[0.0]])).metrics == {}


def test_trl_and_verl_log_the_same_names_after_their_prefix():
    from offpolicy.integrations.verl.loss import rollout_correction  # torch only: verl is not imported

    b = batch([[0.0, 1.0, -1.0, 2.0]], advantages=[1.0])
    correction = op.chain(op.tis(upper=2.0), op.icepop())
    _, trl_metrics = op.policy_loss(b, correction=correction)  # TRL logs these under offpolicy/
    _, _, verl_metrics = rollout_correction(b.old_logp, b.rollout_logp, b.mask, correction, diagnostics=False)
    prefix = "rollout_corr/"
    trl_drop = {k: v for k, v in trl_metrics.items() if k.rsplit("/", 1)[-1] in DROP_NAMES}
    verl_drop = {k[len(prefix) :]: v for k, v in verl_metrics.items() if k.rsplit("/", 1)[-1] in DROP_NAMES}
    assert set(trl_drop) == set(verl_drop) == {f"{n}/{k}" for n in ("chain", "tis", "icepop") for k in DROP_NAMES}
    assert all(torch.equal(trl_drop[k], verl_drop[k]) for k in trl_drop)


# ---------------------------------------------------------------------------------------------------------------------
# Properties over every registered correction
# ---------------------------------------------------------------------------------------------------------------------


def _random_batch(seed: int, rows: int, cols: int, scale: float, on_policy: bool) -> op.LogProbBatch:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g) * 3
    mu = old.clone() if on_policy else old + scale * torch.randn(rows, cols, generator=g)
    mask = (torch.rand(rows, cols, generator=g) < 0.75).float()
    adv = torch.randn(rows, generator=g)
    return op.LogProbBatch(logp=old.clone(), old_logp=old, rollout_logp=mu, mask=mask, advantages=adv)


def _every_correction(name: str) -> Correction:
    c = build_correction({"name": name, **REQUIRED.get(name, {})})
    assert c is not None
    return c


seeds = st.integers(0, 2**31 - 1)


@settings(max_examples=10, deadline=None)
@given(seeds, st.integers(1, 4), st.integers(1, 8))
def test_on_policy_every_correction_keeps_every_token(seed, rows, cols):
    b = _random_batch(seed, rows, cols, 0.0, on_policy=True)
    for name in CORRECTIONS.names():
        c = _every_correction(name)
        assert shares(c(b), c.name) == (1.0, 0.0, 0.0, 0.0), name  # (kl_rejection's name is its mode)


@settings(max_examples=10, deadline=None)
@given(seeds, st.integers(1, 4), st.integers(1, 8), st.sampled_from([0.05, 0.5, 2.0]), st.integers(1, 3))
def test_the_shares_sum_to_one_and_padding_never_counts(seed, rows, cols, scale, pad):
    b = _random_batch(seed, rows, cols, scale, on_policy=False)
    g = torch.Generator().manual_seed(seed + 1)
    junk = 50 * torch.randn(rows, pad, generator=g)  # whatever padding holds, however much of it

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, junk], dim=1)

    wide = op.LogProbBatch(
        logp=padded(b.logp),
        old_logp=padded(b.old_logp),
        rollout_logp=padded(b.rollout_logp),
        mask=torch.cat([b.mask, torch.zeros(rows, pad)], dim=1),
        advantages=b.advantages,
    )
    for name in CORRECTIONS.names():
        c = _every_correction(name)
        r, w = c(b), c(wide)
        kept, masked, capped, seq = (r.metrics[f"{c.name}/{k}"].item() for k in DROP_NAMES)
        assert kept + masked + capped == pytest.approx(1.0, abs=1e-6), name
        assert all(0.0 <= x <= 1.0 for x in (kept, masked, capped, seq)), name
        for k in DROP_NAMES:
            key = f"{c.name}/{k}"
            assert r.metrics[key].item() == pytest.approx(w.metrics[key].item(), abs=1e-6), (name, k)
