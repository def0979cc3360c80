"""Tests for offpolicy.corrections.sequence_masks: token veto, OPSM mask, OPSM decomposition and their presets."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.importance import importance_weights
from offpolicy.corrections.sequence_masks import opsm, opsm_decomposition, opsm_mask, token_veto, veto

NAN, INF = float("nan"), float("inf")


def close(t: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), atol=atol, rtol=1e-5)


@st.composite
def policy_batches(draw, max_b: int = 6, max_t: int = 10):
    """(logp, old_logp, rollout_logp, mask, advantages [B]) with drawn shapes, drift scale and padding."""
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.01, 0.1, 0.5]))
    logp = -3 * torch.rand(b, t, generator=g)
    old = logp + scale * torch.randn(b, t, generator=g)
    roll = old + scale * torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > draw(st.sampled_from([0.0, 0.3]))
    adv = torch.randn(b, generator=g)
    return logp, old, roll, mask, adv


# ---------------------------------------------------------------------------------------------------------------------
# token veto
# ---------------------------------------------------------------------------------------------------------------------


def test_token_veto_by_hand():
    r = torch.tensor([[0.0, math.log(5e-5), 0.0], [math.log(2e-4), 0.0, -99.0], [5.0, 5.0, 5.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    # row 0: ρ = 5e-5 < 1e-4 → vetoed; row 1: 2e-4 ≥ 1e-4, the -99 is padding → kept; row 2: large ρ is not vetoed
    assert token_veto(r, m).tolist() == [[False] * 3, [True, True, False], [True] * 3]


def test_token_veto_threshold_is_strict_and_unclamped():
    at = torch.tensor([[math.log(1e-4)]])
    assert token_veto(at, torch.ones(1, 1)).all()  # ρ == threshold is kept (veto needs ρ < threshold)
    # a threshold below e^-20 still works: no ±20 clamp before the comparison
    r = torch.tensor([[-30.0], [-25.0]])
    assert token_veto(r, torch.ones(2, 1), threshold=math.exp(-27)).tolist() == [[False], [True]]
    # threshold 1 vetoes any sequence with a ratio below 1
    assert token_veto(torch.tensor([[0.0, -1e-3]]), torch.ones(1, 2), threshold=1.0).tolist() == [[False, False]]


def test_token_veto_nonfinite():
    r = torch.tensor([[NAN, 0.0], [-INF, 0.0], [INF, 0.0], [0.0, NAN]])
    m = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    # NaN (undefined) and -inf (ρ = 0) in valid positions veto; +inf does not (ρ is not small); padding NaN ignored
    assert token_veto(r, m).tolist() == [[False, False], [False, False], [True, True], [True, False]]


@pytest.mark.parametrize("bad", [0.0, -1e-4, 1.5, NAN, INF, None, "1e-4", True])
def test_token_veto_threshold_validation(bad):
    with pytest.raises(ValueError, match="threshold"):
        token_veto(torch.zeros(1, 1), torch.ones(1, 1), threshold=bad)
    with pytest.raises(ValueError, match="threshold"):
        veto(threshold=bad)


def test_veto_preset_metrics_and_sources():
    # π_old/μ: row 0 has exp(-12) = 6.1e-6 < 1e-4 → vetoed; row 1 fine; row 2 empty (excluded from the fraction)
    b = LogProbBatch(
        logp=torch.zeros(3, 2),
        old_logp=torch.zeros(3, 2),
        rollout_logp=torch.tensor([[0.0, 12.0], [0.0, 0.1], [50.0, 50.0]]),
        mask=torch.tensor([[1, 1], [1, 1], [0, 0]]),
    )
    r = veto()(b)
    assert r.keep.tolist() == [[False, False], [True, True], [False, False]]
    assert r.weights.tolist() == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    assert r.metrics["veto/masked_seq_frac"].item() == 0.5  # 1 of 2 non-empty
    assert r.metrics["veto/masked_frac"].item() == 0.5 and r.metrics["veto/kept_frac"].item() == 0.5  # 2 of 4 tokens
    # source="total" reads π_θ: make π_θ collapse on row 1 only
    b2 = b.replace(logp=torch.tensor([[0.0, 12.0], [-20.0, 0.0], [0.0, 0.0]]))
    assert veto(source="total")(b2).keep.tolist() == [[True, True], [False, False], [False, False]]
    with pytest.raises(ValueError, match="rollout_logp"):
        veto()(b.replace(rollout_logp=None))
    with pytest.raises(ValueError, match="source"):
        veto(source="old")
    assert repr(veto()) == "veto(threshold=0.0001, source='mismatch')"


@settings(max_examples=50, deadline=None)
@given(policy_batches(), st.integers(0, 2**31 - 1))
def test_token_veto_padding_never_contributes(batch, seed):
    logp, _, roll, m, _ = batch
    r = logp - roll
    g = torch.Generator().manual_seed(seed)
    junk = torch.tensor([NAN, INF, -INF, -1e30])[torch.randint(0, 4, r.shape, generator=g)]
    assert torch.equal(token_veto(r, m, threshold=0.5), token_veto(torch.where(m, r, junk), m, threshold=0.5))
    assert torch.equal(token_veto(torch.zeros_like(r), m), m)  # on-policy: nothing vetoed


# ---------------------------------------------------------------------------------------------------------------------
# OPSM decomposition
# ---------------------------------------------------------------------------------------------------------------------


def test_opsm_decomposition_by_hand_with_padding():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.2, -2.0, 5.0], [-1.0, -1.0, -1.0]])
    roll = torch.tensor([[-1.5, -1.7, NAN], [-0.7, -1.0, -1.3]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    d = opsm_decomposition(logp, old, roll, m)
    # row 0: μ−π = (-0.5, 0.3) → -0.1; μ−π_old = (-0.3, 0.3) → 0; π_old−π = (-0.2, 0) → -0.1
    # row 1: μ−π = (0.3, 0, -0.3) → 0; μ−π_old = same → 0; π_old−π = 0
    close(d["statistic"], [-0.1, 0.0])
    close(d["mismatch"], [0.0, 0.0])
    close(d["staleness"], [-0.1, 0.0])


def test_opsm_decomposition_validates():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="^old_logp"):
        opsm_decomposition(z, torch.zeros(1, 3), z, torch.ones(1, 2))
    with pytest.raises(ValueError, match="^rollout_logp"):
        opsm_decomposition(z, z, torch.zeros(2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="^mask"):
        opsm_decomposition(z, z, z, torch.ones(2, 2))


@settings(max_examples=50, deadline=None)
@given(policy_batches())
def test_decomposition_identity(batch):
    logp, old, roll, m, _ = batch
    d = opsm_decomposition(logp, old, roll, m)
    torch.testing.assert_close(d["statistic"], d["mismatch"] + d["staleness"], atol=1e-5, rtol=1e-5)
    # the mismatch term is minus the training–inference geometric log-ratio log ρ_geo(π_old/μ)
    _, _, raw = importance_weights(old - roll, m, level="geometric")
    geo = torch.where(m.any(-1), torch.log(raw[torch.arange(len(m)), m.float().argmax(-1)]), torch.zeros(len(m)))
    torch.testing.assert_close(d["mismatch"], -geo, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# OPSM mask
# ---------------------------------------------------------------------------------------------------------------------


def test_opsm_mask_by_hand():
    logp = torch.tensor([[-2.0, -2.0], [-2.0, -2.0], [-1.0, -1.0], [-1.5, -1.5]])
    mu = torch.full((4, 2), -1.0)
    adv = torch.tensor([-1.0, 1.0, -1.0, -0.5])
    # stat = mean(μ − π): 1, 1, 0, 0.5 → row 0 (A<0, 1 > 0.5) dropped; row 1 positive A; row 2 stat 0;
    # row 3: stat == δ exactly is kept (the rule is stat > δ)
    keep = opsm_mask(logp, mu, torch.ones(4, 2), adv, delta=0.5)
    assert keep.tolist() == [[False, False], [True, True], [True, True], [True, True]]
    assert opsm_mask(logp, mu, torch.ones(4, 2), adv, delta=0.49)[3].tolist() == [False, False]


def test_opsm_mask_per_token_advantages_use_sequence_mean():
    logp, mu = torch.full((2, 3), -2.0), torch.full((2, 3), -1.0)  # stat 1 for both rows
    adv = torch.tensor([[1.0, -3.0, 100.0], [-1.0, 0.5, 0.2]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # row 0: mean over valid (1 − 3)/2 = −1 < 0 (the 100 is padding) → dropped; row 1: (−1 + 0.5 + 0.2)/3 = −0.1 → dropped
    assert opsm_mask(logp, mu, m, adv, delta=0.5).tolist() == [[False, False, False], [False, False, False]]
    adv2 = torch.tensor([[1.0, -0.5, -100.0], [-1.0, 0.5, 0.6]])  # means 0.25 and 0.033 → both kept
    assert opsm_mask(logp, mu, m, adv2, delta=0.5).tolist() == [[True, True, False], [True, True, True]]


def test_opsm_mask_falls_back_to_old_logp():
    logp, old = torch.full((1, 2), -2.0), torch.full((1, 2), -1.0)
    adv = torch.tensor([-1.0])
    assert not opsm_mask(logp, None, torch.ones(1, 2), adv, delta=0.5, old_logp=old).any()
    # rollout_logp wins over old_logp when both are given
    assert opsm_mask(logp, logp.clone(), torch.ones(1, 2), adv, delta=0.5, old_logp=old).all()
    with pytest.raises(ValueError, match="rollout_logp"):
        opsm_mask(logp, None, torch.ones(1, 2), adv, delta=0.5)


def test_opsm_mask_nonfinite_drops_only_negative_sequences():
    logp = torch.tensor([[NAN, -1.0], [NAN, -1.0], [-1.0, NAN]])
    mu = torch.full((3, 2), -1.0)
    m = torch.tensor([[1, 1], [1, 1], [1, 0]])
    keep = opsm_mask(logp, mu, m, torch.tensor([-1.0, 1.0, -1.0]), delta=0.1)
    # row 0: A<0 with an undefined divergence → dropped; row 1: A>0 never dropped; row 2: NaN is padding → kept
    assert keep.tolist() == [[False, False], [True, True], [True, False]]


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(delta=-0.1), "delta"),
        (dict(delta=NAN), "delta"),
        (dict(delta=INF), "delta"),
        (dict(advantages=torch.zeros(3)), "advantages"),
        (dict(advantages=torch.zeros(2, 4)), "advantages"),
        (dict(rollout_logp=torch.zeros(2, 4)), "rollout_logp"),
        (dict(rollout_logp=None, old_logp=torch.zeros(3, 3)), "old_logp"),
        (dict(mask=torch.ones(2, 4)), "mask"),
        (dict(logp=torch.zeros(2)), "logp"),
    ],
)
def test_opsm_mask_validation(kw, name):
    args = dict(logp=torch.zeros(2, 3), rollout_logp=torch.zeros(2, 3), mask=torch.ones(2, 3), advantages=torch.zeros(2), delta=0.1)
    args.update(kw)
    with pytest.raises(ValueError, match=f"^{name}"):
        opsm_mask(**args)


def test_opsm_delta_zero_allowed():
    keep = opsm_mask(torch.tensor([[-1.001]]), torch.tensor([[-1.0]]), torch.ones(1, 1), torch.tensor([-1.0]), delta=0)
    assert not keep.any()  # 0.001 > 0


@settings(max_examples=50, deadline=None)
@given(policy_batches(), st.sampled_from([1e-4, 0.01, 0.05, 0.3]))
def test_opsm_equals_one_sided_geometric_mask_on_negative_advantages(batch, delta):
    """Seed 004: OPSM drops a negative-advantage sequence iff ρ_geo(π_θ/μ) < e^{−δ}."""
    logp, _, roll, m, adv = batch
    keep = opsm_mask(logp, roll, m, adv, delta=delta)
    _, geo_keep, raw = importance_weights(logp - roll, m, level="geometric", mode="mask", lower=math.exp(-delta))
    neg = (adv < 0).unsqueeze(-1) & m
    # skip tokens whose geometric ratio sits within float rounding of the bound
    clear = (torch.log(raw) + delta).abs() > 1e-5
    assert torch.equal(keep[neg & clear], geo_keep[neg & clear])
    assert torch.equal(keep[(adv >= 0).unsqueeze(-1) & m], m[(adv >= 0).unsqueeze(-1) & m])  # A ≥ 0 never dropped
    assert not (keep & ~m).any()


@settings(max_examples=50, deadline=None)
@given(policy_batches(), st.integers(0, 2**31 - 1))
def test_opsm_padding_never_contributes(batch, seed):
    logp, _, roll, m, adv = batch
    g = torch.Generator().manual_seed(seed)
    junk = lambda: torch.tensor([NAN, INF, -INF, 1e30])[torch.randint(0, 4, m.shape, generator=g)]  # noqa: E731
    a = opsm_mask(logp, roll, m, adv, delta=0.05)
    b = opsm_mask(torch.where(m, logp, junk()), torch.where(m, roll, junk()), m, adv, delta=0.05)
    assert torch.equal(a, b)
    assert torch.equal(opsm_mask(logp, logp.clone(), m, adv, delta=0.0), m)  # on-policy: stat 0, nothing dropped


# ---------------------------------------------------------------------------------------------------------------------
# opsm preset
# ---------------------------------------------------------------------------------------------------------------------


def test_opsm_preset_by_hand():
    b = LogProbBatch(
        logp=torch.tensor([[-2.0, -2.0], [-2.0, -2.0], [-1.0, -1.0], [0.0, 0.0]]),
        old_logp=torch.tensor([[-1.5, -1.5], [-1.5, -1.5], [-1.0, -1.0], [0.0, 0.0]]),
        rollout_logp=torch.full((4, 2), -1.0),
        mask=torch.tensor([[1, 1], [1, 1], [1, 1], [0, 0]]),
        advantages=torch.tensor([-1.0, 1.0, -1.0, -1.0]),
    )
    r = opsm(delta=0.5)(b)
    # stat = μ − π: 1, 1, 0 (row 3 empty); mismatch μ − π_old: 0.5, 0.5, 0; staleness π_old − π: 0.5, 0.5, 0
    assert r.keep.tolist() == [[False, False], [True, True], [True, True], [False, False]]
    metrics = {k: v.item() for k, v in r.metrics.items()}
    assert metrics["opsm/masked_seq_frac"] == pytest.approx(1 / 3)  # of the 3 non-empty sequences
    assert metrics["opsm/masked_frac"] == pytest.approx(2 / 6) and metrics["opsm/capped_frac"] == 0.0  # of 6 tokens
    assert metrics["opsm/stat_mean"] == pytest.approx(2 / 3)
    assert metrics["opsm/mismatch_term_mean"] == pytest.approx(1 / 3)
    assert metrics["opsm/staleness_term_mean"] == pytest.approx(1 / 3)
    assert r.weights.tolist() == [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    assert repr(opsm(delta=0.5)) == "opsm(delta=0.5)"


def test_opsm_preset_fallbacks_and_errors():
    logp, old = torch.full((1, 2), -2.0), torch.full((1, 2), -1.0)
    b = LogProbBatch(logp=logp, old_logp=old, mask=torch.ones(1, 2), advantages=torch.tensor([-1.0]))
    r = opsm(delta=0.5)(b)  # μ := π_old → stat 1 > 0.5 → dropped; mismatch term 0, staleness 1
    assert not r.keep.any()
    assert r.metrics["opsm/mismatch_term_mean"].item() == 0.0 and r.metrics["opsm/staleness_term_mean"].item() == 1.0
    with pytest.raises(ValueError, match="advantages"):
        opsm()(b.replace(advantages=None))
    with pytest.raises(ValueError, match="rollout_logp"):
        opsm()(b.replace(old_logp=None))
    with pytest.raises(ValueError, match="delta"):
        opsm(delta=-1.0)


@settings(max_examples=30, deadline=None)
@given(policy_batches())
def test_opsm_preset_matches_function(batch):
    logp, old, roll, m, adv = batch
    b = LogProbBatch(logp=logp.requires_grad_(), old_logp=old, rollout_logp=roll, mask=m, advantages=adv)
    r = opsm(delta=0.02)(b)
    assert torch.equal(r.keep, opsm_mask(logp, roll, m, adv, delta=0.02))
    d = opsm_decomposition(logp, old, roll, m)
    nonempty = m.any(-1)
    if nonempty.any():
        assert r.metrics["opsm/mismatch_term_mean"].item() == pytest.approx(d["mismatch"][nonempty].mean().item(), abs=1e-6)
        assert r.metrics["opsm/staleness_term_mean"].item() == pytest.approx(d["staleness"][nonempty].mean().item(), abs=1e-6)


@settings(max_examples=50, deadline=None)
@given(
    st.sampled_from(["logp", "rollout_logp", "mask", "advantages", "log_ratio", "veto_mask"]),
    st.lists(st.integers(1, 5), max_size=3),
)
def test_fuzz_wrong_shapes_name_the_argument(bad, shape):
    b, t = 2, 3
    shape = tuple(shape)
    args = dict(logp=torch.zeros(b, t), rollout_logp=torch.zeros(b, t), mask=torch.ones(b, t), advantages=torch.zeros(b))
    if bad in ("log_ratio", "veto_mask"):
        r, m = torch.zeros(b, t), torch.ones(b, t)
        if bad == "log_ratio":
            r = torch.zeros(shape)
        else:
            m = torch.ones(shape)
        if r.shape == m.shape and r.dim() == 2:
            token_veto(r, m)
        else:
            with pytest.raises(ValueError, match="^log_ratio" if r.dim() != 2 else "^mask"):
                token_veto(r, m)
        return
    args[bad] = torch.zeros(shape) if bad != "mask" else torch.ones(shape)
    ok = shape == (b, t) or (bad == "advantages" and shape == (b,))
    if ok:
        opsm_mask(**args, delta=0.1)
    else:
        # a wrong logp makes the others mismatch too; the complaint must name logp or the first field compared to it
        with pytest.raises(ValueError, match="^(logp|rollout_logp)" if bad == "logp" else f"^{bad}"):
            opsm_mask(**args, delta=0.1)
