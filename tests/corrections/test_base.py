"""Tests for offpolicy.corrections.base: CorrectionResult, Correction and chain (chain == one by one)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction, CorrectionResult, chain
from offpolicy.corrections.gated import gated_is
from offpolicy.corrections.importance import geo_mask, icepop, importance_correction, mis, tis
from offpolicy.corrections.sequence_masks import opsm, veto
from offpolicy.corrections.trust_region import ln_trm, ser, trm


def test_coefficient_is_weight_where_kept():
    r = CorrectionResult(torch.tensor([[2.0, 3.0, 0.5]]), torch.tensor([[True, False, True]]))
    assert r.coefficient.tolist() == [[2.0, 0.0, 0.5]]


def test_identity_is_mask():
    b = LogProbBatch(logp=torch.zeros(1, 3), mask=torch.tensor([[1, 1, 0]]))
    r = CorrectionResult.identity(b)
    assert r.weights.tolist() == [[1.0, 1.0, 0.0]] and r.keep.tolist() == [[True, True, False]] and r.metrics == {}


def test_then_multiplies_ands_and_merges():
    a = CorrectionResult(torch.tensor([[2.0, 0.5]]), torch.tensor([[True, True]]), {"a/x": torch.tensor(1.0), "s": torch.tensor(1.0)})
    b = CorrectionResult(torch.tensor([[3.0, 4.0]]), torch.tensor([[True, False]]), {"b/y": torch.tensor(2.0), "s": torch.tensor(9.0)})
    c = a.then(b)
    # weights 2·3 = 6, 0.5·4 = 2; keep T&T, T&F; a later metric name wins
    assert c.weights.tolist() == [[6.0, 2.0]] and c.keep.tolist() == [[True, False]]
    assert {k: v.item() for k, v in c.metrics.items()} == {"a/x": 1.0, "b/y": 2.0, "s": 9.0}


def test_correction_call_detaches_weights_and_repr():
    def fn(batch):
        return CorrectionResult(batch.logp * 2, batch.bool_mask)

    c = Correction("double", fn, {"k": 1, "s": "x"})
    b = LogProbBatch(logp=torch.ones(1, 2, requires_grad=True), mask=torch.ones(1, 2))
    out = c(b)
    assert not out.weights.requires_grad and out.weights.tolist() == [[2.0, 2.0]]
    assert repr(c) == "double(k=1, s='x')"


def test_chain_rejects_non_corrections():
    with pytest.raises(ValueError, match="chain argument 1"):
        chain(tis(), lambda b: b)  # type: ignore[arg-type]


def test_empty_chain_is_identity():
    b = LogProbBatch(logp=torch.zeros(2, 2), mask=torch.tensor([[1, 0], [1, 1]]))
    r = chain()(b)
    assert r.weights.tolist() == [[1.0, 0.0], [1.0, 1.0]] and r.keep.tolist() == [[True, False], [True, True]]
    assert r.metrics["chain/kept_frac"].item() == 1.0 and r.metrics["chain/masked_frac"].item() == 0.0


def test_chain_by_hand_and_repr():
    # ρ = π_old/μ per token = exp(0), exp(1.0), exp(-1.0) = 1, 2.718, 0.368
    b = LogProbBatch(logp=torch.zeros(1, 3), rollout_logp=torch.tensor([[0.0, -1.0, 1.0]]), mask=torch.ones(1, 3))
    c = chain(tis(upper=2.0), icepop(lower=0.5, upper=5.0))
    r = c(b)
    # tis: (1, min(2.718, 2) = 2, 0.368); icepop keeps 1 and 2.718 (in [0.5, 5]) with w = ρ, drops 0.368
    # product: (1·1, 2·2.718 = 5.4366, 0); keep (T, T, F): the chain masks 1/3, caps 1/3 (tis's), keeps 1/3
    torch.testing.assert_close(r.weights, torch.tensor([[1.0, 2.0 * torch.e, 0.0]]))
    assert r.keep.tolist() == [[True, True, False]]
    m = {k: round(v.item(), 6) for k, v in r.metrics.items()}
    assert (m["chain/kept_frac"], m["chain/masked_frac"], m["chain/capped_frac"]) == (0.333333, 0.333333, 0.333333)
    assert (m["tis/kept_frac"], m["tis/masked_frac"], m["tis/capped_frac"]) == (0.666667, 0.0, 0.333333)
    assert (m["icepop/kept_frac"], m["icepop/masked_frac"], m["icepop/capped_frac"]) == (0.666667, 0.333333, 0.0)
    assert m["chain/masked_seq_frac"] == m["tis/masked_seq_frac"] == m["icepop/masked_seq_frac"] == 0.0
    assert repr(c).startswith("chain(tis(level='token'") and c.parts[1].name == "icepop"


def test_chain_refuses_two_parts_whose_metrics_collide_and_accepts_renamed_ones(random_batch):
    batch = random_batch(0, 2, 3, 0.1)
    with pytest.raises(ValueError, match=r"tis/raw_ratio_mean.*same name"):
        chain(tis(), tis(level="geometric"))(batch)
    r = chain(tis(), importance_correction("geometric", "truncate", upper=2.0, name="tis_geo"))(batch)
    assert "tis/weight_mean" in r.metrics and "tis_geo/weight_mean" in r.metrics
    # a nested chain's own summary is superseded by the outer one's, not a clash
    r = chain(chain(tis(), icepop()), chain(opsm(delta=0.1)))(batch)
    assert "chain/kept_frac" in r.metrics and "opsm/masked_seq_frac" in r.metrics


# ---------------------------------------------------------------------------------------------------------------------
# chain == one by one, over random batches and random subsets of presets
# ---------------------------------------------------------------------------------------------------------------------

PRESETS = [
    tis(),
    tis(upper=1.5, lower=0.8, level="geometric", normalize=True),
    mis(upper=3.0, level="sequence", lower=0.2),
    importance_correction("token", "mask", lower=0.9, source="total", name="is_total"),
    geo_mask(lower=0.9, upper=1.1),
    icepop(),
    opsm(delta=0.05),
    veto(threshold=0.3),
    trm(max_kl=0.02, avg_kl=0.005),
    ln_trm(eps=0.01, delta=0.01, threshold=0.1),
    ser(threshold=0.1),
    gated_is(level="geometric", gating="binary_kl", upper=0.01),
    gated_is(gating="tv", upper=0.02, name="gated_tv"),
    gated_is(level="sequence", lower=0.5, upper=2.0, name="gated_seq"),
    gated_is(mode="truncate", lower=0.8, upper=1.25, source="total", name="gated_clip"),
]


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 5),
    st.integers(1, 12),
    st.sampled_from([0.01, 0.1, 0.5]),
    st.lists(st.sampled_from(range(len(PRESETS))), min_size=0, max_size=5),
)
def test_chain_equals_one_by_one(random_batch, seed, b, t, scale, idx):
    batch = random_batch(seed, b, t, scale)
    parts = [PRESETS[i] for i in idx]
    names = [k for c in parts for k in c(batch).metrics]
    if len(set(names)) < len(names):  # two parts of one name: their metrics would overwrite each other
        with pytest.raises(ValueError, match="same name"):
            chain(*parts)(batch)
        return
    chained = chain(*parts)(batch)
    expected = CorrectionResult.identity(batch)
    for c in parts:
        expected = expected.then(c(batch))
    assert torch.equal(chained.weights, expected.weights)
    assert torch.equal(chained.keep, expected.keep)
    for k, v in expected.metrics.items():
        assert torch.equal(chained.metrics[k], v)
    # the chain is also the product / AND of the individual results, in any order
    w, keep = batch.bool_mask.float(), batch.bool_mask
    for c in reversed(parts):
        r = c(batch)
        w, keep = w * r.weights, keep & r.keep
    torch.testing.assert_close(chained.weights, w)
    assert torch.equal(chained.keep, keep)
    assert not chained.weights.requires_grad


# ---------------------------------------------------------------------------------------------------------------------
# properties every preset must have
# ---------------------------------------------------------------------------------------------------------------------

DEFAULTS = [tis(), tis(normalize=True), mis(), mis(level="sequence"), geo_mask(), icepop(), opsm(), veto(), trm(), ln_trm(), ser(),
            gated_is()]


@settings(max_examples=30, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 5),
    st.integers(1, 12),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_on_policy_every_preset_is_identity(random_batch, seed, b, t, dtype):
    """All log-ratios 0 (π_θ = π_old = μ) ⇒ weights 1 on valid tokens and nothing masked, for every preset."""
    base = random_batch(seed, b, t, 0.0)
    lp = base.logp.to(dtype)
    batch = LogProbBatch(logp=lp, old_logp=lp.clone(), rollout_logp=lp.clone(), mask=base.mask, advantages=base.advantages)
    for c in DEFAULTS + PRESETS:
        r = c(batch)
        assert torch.equal(r.keep, batch.bool_mask), c
        assert torch.equal(r.weights, batch.bool_mask.float()), c
        assert r.weights.dtype == torch.float32
    # the same with the on-policy fallbacks (no old_logp)
    r = chain(*{c.name: c for c in DEFAULTS}.values())(batch.replace(old_logp=None))  # one preset per name
    assert torch.equal(r.coefficient, batch.bool_mask.float())


def _junk(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -5.0])[torch.randint(0, 5, x.shape, generator=g)]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 5), st.integers(1, 12), st.sampled_from([0.01, 0.3]))
def test_every_preset_ignores_padding(random_batch, seed, b, t, scale):
    batch = random_batch(seed, b, t, scale)
    m = batch.bool_mask
    junked = batch.replace(
        logp=torch.where(m, batch.logp, _junk(batch.logp, seed)),
        old_logp=torch.where(m, batch.old_logp, _junk(batch.logp, seed + 1)),
        rollout_logp=torch.where(m, batch.rollout_logp, _junk(batch.logp, seed + 2)),
    )
    for c in DEFAULTS + PRESETS:
        a, z = c(batch), c(junked)
        assert torch.equal(a.weights, z.weights), c
        assert torch.equal(a.keep, z.keep), c
        for k in a.metrics:
            assert torch.equal(a.metrics[k], z.metrics[k]), (c, k)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 5), st.integers(1, 12))
def test_every_preset_nonfinite_valid_logprobs_never_nan(random_batch, seed, b, t):
    batch = random_batch(seed, b, t, 0.1)
    g = torch.Generator().manual_seed(seed)
    hit = torch.rand(b, t, generator=g) < 0.2
    nonfinite = torch.tensor([float("nan"), float("inf"), -float("inf")])[torch.randint(0, 3, (b, t), generator=g)]
    bad = torch.where(hit, nonfinite, batch.old_logp)
    nb = batch.replace(old_logp=bad)
    for c in DEFAULTS + PRESETS:
        r = c(nb)
        assert bool(torch.isfinite(r.weights).all()), c
        assert all(bool(torch.isfinite(v)) for v in r.metrics.values()), c


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 5), st.integers(1, 12), st.sampled_from([torch.bfloat16, torch.float16]))
def test_every_preset_computes_low_precision_inputs_in_float32(random_batch, seed, b, t, dtype):
    """bf16/fp16 log-probs give exactly the result of their float32 upcast: differences are taken in float32."""
    batch = random_batch(seed, b, t, 0.1)
    low = batch.replace(logp=batch.logp.to(dtype), old_logp=batch.old_logp.to(dtype), rollout_logp=batch.rollout_logp.to(dtype))
    up = batch.replace(logp=low.logp.float(), old_logp=low.old_logp.float(), rollout_logp=low.rollout_logp.float())
    for c in DEFAULTS + PRESETS:
        a, z = c(low), c(up)
        assert a.weights.dtype == torch.float32
        assert torch.equal(a.weights, z.weights) and torch.equal(a.keep, z.keep), c
