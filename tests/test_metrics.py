"""offpolicy_metrics: ms-swift names, hand-computed values, on-policy and padding properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.metrics import METRIC_NAMES, offpolicy_metrics

E = math.e
PAD = float("nan")


def example():
    # r = log π − log μ = [[0, -1], [1, pad]]
    train = torch.tensor([[-1.0, -2.0], [-1.0, PAD]])
    rollout = torch.tensor([[-1.0, -1.0], [-2.0, 123.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    return train, rollout, mask


def test_names_follow_ms_swift_and_prefix():
    train, rollout, mask = example()
    m = offpolicy_metrics(train, rollout, mask)
    ms_swift = {
        "kl", "k3_kl", "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
        "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq", "ess",
        "is_weight_mean", "clipped_frac",
    }  # fmt: skip
    assert {f"rollout_correction/{k}" for k in ms_swift} <= set(m)
    assert set(m) == {f"rollout_correction/{k}" for k in METRIC_NAMES}
    assert all(v.dim() == 0 and v.dtype == torch.float32 for v in m.values())
    assert set(offpolicy_metrics(train, rollout, mask, prefix="x/")) == {f"x/{k}" for k in METRIC_NAMES}


def test_hand_computed_values():
    train, rollout, mask = example()
    m = offpolicy_metrics(train, rollout, mask, prefix="")
    v = {k: t.item() for k, t in m.items()}
    approx = lambda x: pytest.approx(x, rel=1e-5, abs=1e-6)  # noqa: E731
    # kl = mean(log μ − log π) = (0 + 1 − 1) / 3 = 0
    assert v["kl"] == approx(0.0)
    # k3 = mean(ρ − r − 1): r=0 → 0; r=−1 → e⁻¹ = 0.367879; r=1 → e − 2 = 0.718282; sum 1.086161 / 3
    assert v["k3_kl"] == approx((math.exp(-1) + E - 2) / 3)
    # training PPL per sequence: seq0 mean log π = −1.5 → e^1.5 = 4.481689; seq1 −1 → e = 2.718282; mean 3.599986
    assert v["training_ppl"] == approx((math.exp(1.5) + E) / 2)
    assert v["training_log_ppl"] == approx(1.25)  # (1.5 + 1) / 2
    # rollout: seq0 mean −1 → e; seq1 −2 → e² = 7.389056; mean 5.053669, log (1 + 2)/2 = 1.5
    assert v["rollout_ppl"] == approx((E + math.exp(2)) / 2)
    assert v["rollout_log_ppl"] == approx(1.5)
    # d_i = mean log μ − mean log π: seq0 −1 + 1.5 = 0.5, seq1 −2 + 1 = −1
    assert v["log_ppl_diff"] == approx(-0.25)
    assert v["log_ppl_abs_diff"] == approx(0.75)
    assert v["log_ppl_diff_max"] == approx(0.5)
    assert v["log_ppl_diff_min"] == approx(-1.0)
    assert v["ppl_ratio"] == approx((math.exp(0.5) + math.exp(-1)) / 2)  # 1.008300
    # χ²_token = mean ρ² − 1 = (1 + e⁻² + e²)/3 − 1 = 1.841464
    assert v["chi2_token"] == approx((1 + math.exp(-2) + math.exp(2)) / 3 - 1)
    # χ²_seq (geometric): seq0 mean r = −0.5 → ρ² = e⁻¹; seq1 1 → e²; (0.367879 + 7.389056)/2 − 1 = 2.878468
    assert v["chi2_seq"] == approx((math.exp(-1) + math.exp(2)) / 2 - 1)
    # χ²_seq_product: seq0 Σr = −1 → e⁻²; seq1 → e²; (0.135335 + 7.389056)/2 − 1 = 2.762196
    assert v["chi2_seq_product"] == approx((math.exp(-2) + math.exp(2)) / 2 - 1)
    # no weights: w = ρ = (1, e⁻¹, e); mean 1.362054; ESS = mean² / mean ρ² = 1.855190 / 2.841464 = 0.652901
    w_mean = (1 + math.exp(-1) + E) / 3
    assert v["is_weight_mean"] == approx(w_mean)
    assert v["ess"] == approx(w_mean**2 / ((1 + math.exp(-2) + math.exp(2)) / 3))
    assert v["raw_ratio_mean"] == approx(w_mean)
    assert v["raw_ratio_max"] == approx(E)
    assert v["raw_ratio_min"] == approx(math.exp(-1))
    assert v["clipped_frac"] == 0.0 and v["masked_frac"] == 0.0 and v["accepted_frac"] == 1.0
    assert v["nonfinite_tokens"] == 0.0  # the NaN sits at a masked position


def test_with_weights():
    train, rollout, mask = example()
    weights = torch.tensor([[1.0, 0.5], [0.0, PAD]])
    v = {k: t.item() for k, t in offpolicy_metrics(train, rollout, mask, weights, prefix="").items()}
    assert v["is_weight_mean"] == pytest.approx(0.5)  # (1 + 0.5 + 0) / 3
    assert v["masked_frac"] == pytest.approx(1 / 3) and v["accepted_frac"] == pytest.approx(2 / 3)
    # w vs raw ρ = (1, e⁻¹, e): token 0 unchanged, tokens 1 and 2 changed → 2/3
    assert v["clipped_frac"] == pytest.approx(2 / 3)
    # ESS = mean² / mean w² = 0.25 / ((1 + 0.25 + 0)/3) = 0.6
    assert v["ess"] == pytest.approx(0.6, rel=1e-6)
    # raw stats ignore the weights
    assert v["raw_ratio_max"] == pytest.approx(E, rel=1e-6)


def test_clipped_frac_at_geometric_level():
    train, rollout, mask = example()
    # geometric raw ratio: seq0 e^-0.5 = 0.606531 (both tokens), seq1 e^1 → a truncation at 2 changes only seq1
    weights = torch.tensor([[math.exp(-0.5), math.exp(-0.5)], [2.0, 0.0]])
    v = offpolicy_metrics(train, rollout, mask, weights, level="geometric", prefix="")
    assert v["clipped_frac"].item() == pytest.approx(1 / 3)



@pytest.mark.parametrize("pass_result", [False, True])
def test_untouched_small_ratios_are_not_counted_as_clipped(pass_result):
    # log ρ from −12 to 0: ρ down to 6e-6, where expm1(r) + 1 is off by ~1e-6 relative in float32. Weights that are
    # exactly the raw ratios (a tis with no bound that binds: upper = 1e6) must give clipped_frac 0; a truncation at
    # upper = 0.5 changes exactly the tokens with ρ > 0.5, i.e. log ρ > −0.693: those with r ∈ {−0.5, −0.25, 0} of the
    # 49 values −12, −11.75, …, 0 → 3/49.
    from offpolicy.batch import LogProbBatch
    from offpolicy.corrections.importance import tis

    r = torch.linspace(-12.0, 0.0, 49).reshape(1, 49)
    rollout = -torch.rand(1, 49, generator=torch.Generator().manual_seed(0)) - 1.0
    train = rollout + r
    mask = torch.ones(1, 49)
    for upper, expected in ((1e6, 0.0), (0.5, 3 / 49)):
        result = tis(upper=upper)(LogProbBatch(logp=train.clone(), old_logp=train, rollout_logp=rollout, mask=mask))
        weights = result if pass_result else result.weights
        v = offpolicy_metrics(train, rollout, mask, weights, prefix="")
        assert v["clipped_frac"].item() == pytest.approx(expected, abs=1e-7)

def test_nonfinite_valid_tokens_counted_and_excluded(monkeypatch):
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")  # non-finite μ on purpose: the paths past the limit
    train, rollout, mask = example()
    train2 = torch.cat([train, torch.tensor([[float("inf")], [-1.0]])], dim=1)
    rollout2 = torch.cat([rollout, torch.tensor([[-1.0], [float("nan")]])], dim=1)
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    a = offpolicy_metrics(train, rollout, mask)
    b = offpolicy_metrics(train2, rollout2, mask2)
    assert b["rollout_correction/nonfinite_tokens"].item() == 2.0
    assert b["rollout_correction/nonfinite_rollout_tokens"].item() == 1.0  # the NaN μ; the inf is π's
    for k in a:
        if "nonfinite" not in k:
            torch.testing.assert_close(a[k], b[k], msg=k)


def test_all_masked_is_finite_and_neutral():
    train = torch.tensor([[PAD, -1.0]])
    m = offpolicy_metrics(train, torch.tensor([[float("inf"), -3.0]]), torch.zeros(1, 2), torch.tensor([[PAD, 0.0]]), prefix="")
    assert all(torch.isfinite(v).item() for v in m.values())
    for k in ("kl", "k3_kl", "chi2_token", "chi2_seq", "chi2_seq_product", "log_ppl_diff", "clipped_frac", "masked_frac"):
        assert m[k].item() == 0.0, k
    for k in ("training_ppl", "rollout_ppl", "ppl_ratio", "ess", "is_weight_mean", "accepted_frac", "raw_ratio_max"):
        assert m[k].item() == 1.0, k


def test_all_weights_zero_gives_zero_ess():
    train, rollout, mask = example()
    m = offpolicy_metrics(train, rollout, mask, torch.zeros(2, 2))
    assert m["rollout_correction/ess"].item() == 0.0
    assert m["rollout_correction/masked_frac"].item() == 1.0


def test_grad_inputs_are_detached_and_no_grad_leaks():
    train = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    m = offpolicy_metrics(train, torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2))
    assert all(not v.requires_grad for v in m.values())


def test_validation():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="rollout_logp"):
        offpolicy_metrics(x, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        offpolicy_metrics(x, x, torch.ones(3, 3))
    with pytest.raises(ValueError, match="weights"):
        offpolicy_metrics(x, x, torch.ones(2, 3), torch.ones(2))
    with pytest.raises(ValueError, match="level"):
        offpolicy_metrics(x, x, torch.ones(2, 3), level="seq")


# ---------------------------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------------------------


@st.composite
def pairs(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    f = st.floats(-10.0, 0.0, allow_nan=False, width=32)
    train = torch.tensor(draw(st.lists(f, min_size=B * T, max_size=B * T))).view(B, T)
    rollout = torch.tensor(draw(st.lists(f, min_size=B * T, max_size=B * T))).view(B, T)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))).view(B, T)
    return train, rollout, mask


@settings(max_examples=50, deadline=None)
@given(pairs())
def test_on_policy_is_neutral(data):
    train, _, mask = data
    m = offpolicy_metrics(train, train.clone(), mask, prefix="")
    for k in ("kl", "k3_kl", "chi2_token", "chi2_seq", "chi2_seq_product", "log_ppl_diff", "log_ppl_abs_diff"):
        assert m[k].item() == pytest.approx(0.0, abs=1e-6), k
    for k in ("ess", "ppl_ratio", "is_weight_mean", "raw_ratio_max", "raw_ratio_min"):
        assert m[k].item() == pytest.approx(1.0, abs=1e-6), k
    torch.testing.assert_close(m["training_ppl"], m["rollout_ppl"])


@settings(max_examples=50, deadline=None)
@given(pairs(), st.integers(0, 2**31 - 1))
def test_padding_never_matters_and_ranges(data, seed):
    train, rollout, mask = data
    g = torch.Generator().manual_seed(seed)
    junk = torch.randn(train.shape, generator=g) * 1e3
    junk[torch.rand(train.shape, generator=g) < 0.4] = float("nan")
    weights = torch.rand(train.shape, generator=g) * 3
    weights[torch.rand(train.shape, generator=g) < 0.3] = 0.0
    a = offpolicy_metrics(train, rollout, mask, weights)
    b = offpolicy_metrics(torch.where(mask, train, junk), torch.where(mask, rollout, -junk), mask, torch.where(mask, weights, junk))
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k)
        assert torch.isfinite(b[k]), k
    assert 0.0 <= a["rollout_correction/ess"].item() <= 1.0
    assert a["rollout_correction/k3_kl"].item() >= -1e-6  # k3 ≥ 0 token by token
    frac = a["rollout_correction/masked_frac"] + a["rollout_correction/accepted_frac"]
    assert frac.item() == pytest.approx(1.0)


@settings(max_examples=30, deadline=None)
@given(pairs(), st.floats(0.1, 10.0))
def test_ess_scale_invariant(data, c):
    """ESS = 1/E[(w/E w)²] does not change when every weight is multiplied by c."""
    train, rollout, mask = data
    w = torch.exp((train - rollout).clamp(-5, 5))
    a = offpolicy_metrics(train, rollout, mask, w)["rollout_correction/ess"]
    b = offpolicy_metrics(train, rollout, mask, w * c)["rollout_correction/ess"]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_mostly_padded_batch_is_exact():
    B, T = 4, 100_000
    train = torch.zeros(B, T)
    rollout = torch.zeros(B, T)
    rollout[1, 3] = -math.log(1.5)  # ρ = 1.5 on the only valid token
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[1, 3] = True
    w = torch.zeros(B, T)
    w[1, 3] = 1.5
    m = offpolicy_metrics(train, rollout, mask, w, prefix="")
    assert m["raw_ratio_mean"].item() == pytest.approx(1.5, rel=1e-6)
    assert m["chi2_token"].item() == pytest.approx(1.25, rel=1e-5)  # 1.5² − 1
    assert m["clipped_frac"].item() == 0.0 and m["masked_frac"].item() == 0.0
    assert m["ess"].item() == pytest.approx(1.0)


def test_inputs_are_not_mutated():
    train, rollout, mask = example()
    weights = torch.tensor([[1.0, float("inf")], [0.0, PAD]])
    before = [x.clone() for x in (train, rollout, mask, weights)]
    offpolicy_metrics(train, rollout, mask, weights)
    for x, y in zip((train, rollout, mask, weights), before):
        torch.testing.assert_close(x, y, equal_nan=True)


def _messy_batch(data, B: int, T: int):
    """Random log-probs with NaN/±inf sprinkled in valid and padded positions, random padding, [B] advantages."""
    special = st.sampled_from([float("nan"), float("inf"), -float("inf")])
    value = st.one_of(st.floats(-6.0, 0.0, width=32), special) if data.draw(st.booleans()) else st.floats(-6.0, 0.0, width=32)
    grid = st.lists(st.lists(value, min_size=T, max_size=T), min_size=B, max_size=B)
    old = torch.tensor(data.draw(grid), dtype=torch.float32)
    rollout = torch.tensor(data.draw(grid), dtype=torch.float32)
    mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=B, max_size=B)))
    from offpolicy.batch import LogProbBatch

    return LogProbBatch(logp=old.clone(), old_logp=old, rollout_logp=rollout, mask=mask, advantages=torch.randn(B),
                        max_nonfinite_rollout=None)  # non-finite μ on purpose


@settings(max_examples=60, deadline=None)
@given(data=st.data(), B=st.integers(1, 4), T=st.integers(1, 6), which=st.sampled_from(["tis", "icepop", "geo", "chain", "opsm"]))
def test_passing_the_result_equals_passing_its_coefficient_at_its_level(data, B, T, which):
    # offpolicy_metrics(old, μ, mask, result) reads the result's coefficient and the level of its weights; the numbers
    # must be those of offpolicy_metrics(old, μ, mask, result.coefficient, level=that level)
    from offpolicy.corrections.base import chain
    from offpolicy.corrections.importance import icepop, mis, tis
    from offpolicy.corrections.sequence_masks import opsm

    batch = _messy_batch(data, B, T)
    correction = {
        "tis": tis(upper=2.0), "icepop": icepop(), "geo": mis(level="geometric", lower=0.5, upper=2.0),
        "chain": chain(tis(upper=2.0), opsm(delta=1e-4), icepop()), "opsm": opsm(delta=1e-4),
    }[which]  # fmt: skip
    result = correction(batch)
    from_result = offpolicy_metrics(batch.old_logp, batch.rollout_logp, batch.mask, result)
    level = result.weight_level if result.weight_level in ("token", "sequence", "geometric") else "token"
    from_tensor = offpolicy_metrics(batch.old_logp, batch.rollout_logp, batch.mask, result.coefficient, level=level)
    for k in from_tensor:
        if k.endswith("clipped_frac") and result.weight_level is None:  # a pure mask: clipped = masked
            assert torch.equal(from_result[k], from_result[k.replace("clipped_frac", "masked_frac")])
            continue
        assert torch.equal(from_result[k], from_tensor[k]) or (from_result[k].isnan() & from_tensor[k].isnan()), k


def test_clipped_frac_of_a_result_follows_its_weights():
    # A pure mask (opsm, trm, …) keeps weight 1 ≠ ρ on every token: "truncated or masked" must be the masked
    # fraction, not ~1. A geometric mis result is compared with the geometric ratio without passing level=.
    from offpolicy.batch import LogProbBatch
    from offpolicy.corrections.base import chain
    from offpolicy.corrections.importance import mis
    from offpolicy.corrections.sequence_masks import opsm

    # r = log π_old − log μ: row 0 = (0.5, 0.5) (geometric ρ = e^0.5 = 1.65), row 1 = (−0.1, −0.1) (ρ = 0.905)
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    rollout = torch.tensor([[-1.5, -1.5], [-0.9, -0.9]])
    b = LogProbBatch(logp=old.clone(), old_logp=old, rollout_logp=rollout, mask=torch.ones(2, 2),
                     advantages=torch.tensor([-1.0, 1.0]))
    # opsm (δ = 0.1): row 0 has A < 0 and mean(log μ − log π) = −0.5 ≤ 0.1 → kept; row 1 has A > 0 → kept: 0 masked
    m = offpolicy_metrics(old, rollout, b.mask, opsm(delta=0.1)(b), prefix="")
    assert m["clipped_frac"].item() == 0.0 and m["masked_frac"].item() == 0.0
    # mis geometric [0.5, 1.5]: row 0 (1.65) dropped, row 1 kept with w = ρ_geo: 2 of 4 tokens changed
    r = mis(level="geometric", lower=0.5, upper=1.5)(b)
    assert r.weight_level == "geometric"
    assert offpolicy_metrics(old, rollout, b.mask, r, prefix="")["clipped_frac"].item() == 0.5
    # a chain keeps the ratio's level; two levels are "mixed" and compared at token level
    assert chain(opsm(delta=0.1), r_c := mis(level="geometric", upper=1.5))(b).weight_level == "geometric"
    from offpolicy.corrections.importance import tis

    assert chain(r_c, tis(upper=2.0))(b).weight_level == "mixed"


# ---------------------------------------------------------------------------------------------------------------------
# Framework names and the statistics they need
# ---------------------------------------------------------------------------------------------------------------------


def test_the_same_numbers_under_each_frameworks_names():
    from offpolicy.metrics import NAMINGS, metric_names

    train, rollout, mask = example()
    weights = torch.tensor([[1.0, 0.5], [0.0, PAD]])
    swift = offpolicy_metrics(train, rollout, mask, weights, prefix="")
    verl = offpolicy_metrics(train, rollout, mask, weights, naming="verl")
    trl = offpolicy_metrics(train, rollout, mask, weights, naming="trl")
    assert list(verl) == list(metric_names("verl")) and list(trl) == list(metric_names("trl"))
    assert len(set(verl)) == len(set(trl)) == len(swift)  # renames never collide
    for name in swift:
        assert torch.equal(verl[NAMINGS["verl"].key(name)], swift[name])
        assert torch.equal(trl[NAMINGS["trl"].key(name)], swift[name])
    # verl's chi2_seq is the product ratio's; ms-swift's (ours) the geometric one
    assert torch.equal(verl["rollout_corr/chi2_seq"], swift["chi2_seq_product"])
    assert torch.equal(verl["rollout_corr/chi2_seq_geometric"], swift["chi2_seq"])
    assert torch.equal(verl["rollout_corr/rollout_is_eff_sample_size"], swift["ess"])
    assert torch.equal(trl["sampling/importance_sampling_ratio/min"], swift["is_weight_min"])
    with pytest.raises(ValueError, match="naming"):
        offpolicy_metrics(train, rollout, mask, naming="wandb")
    # OpenRLHF's and Tinker's names: the same numbers again
    for naming in ("openrlhf", "tinker"):
        named = offpolicy_metrics(train, rollout, mask, weights, naming=naming)
        assert list(named) == list(metric_names(naming)) and len(set(named)) == len(swift)
        for name in swift:
            assert torch.equal(named[NAMINGS[naming].key(name)], swift[name])
    assert metric_names("openrlhf")[0] == "train/vllm_kl"


def test_tinkers_kl_sample_train_v1_and_v2_by_hand():
    # Tinker cookbook: v1 = mean(sampler logp − trainer logp), v2 = ½ mean((sampler − trainer)²) over generated tokens
    # trainer (−1, −2 | −0.5, pad), sampler (−1.5, −1 | −0.5, pad): differences μ − π = (−0.5, 1, 0)
    # v1 = (−0.5 + 1 + 0)/3 = 0.166667; v2 = ½ (0.25 + 1 + 0)/3 = 0.208333
    train = torch.tensor([[-1.0, -2.0], [-0.5, 7.0]])
    rollout = torch.tensor([[-1.5, -1.0], [-0.5, float("nan")]])
    mask = torch.tensor([[1, 1], [1, 0]])
    m = offpolicy_metrics(train, rollout, mask, naming="tinker")
    assert m["optim/kl_sample_train_v1"].item() == pytest.approx(0.5 / 3)
    assert m["optim/kl_sample_train_v2"].item() == pytest.approx(1.25 / 6)
    assert m["optim/k3_kl"].item() > 0  # names Tinker has no metric for keep ours under its prefix


def test_weight_extremes_and_log_prob_differences_by_hand():
    train, rollout, mask = example()
    m = offpolicy_metrics(train, rollout, mask, torch.tensor([[1.0, 0.5], [0.25, PAD]]), prefix="")
    # weights over the 3 valid tokens: 1, 0.5, 0.25 (the NaN is padding)
    assert m["is_weight_max"].item() == 1.0 and m["is_weight_min"].item() == 0.25
    # |log π − log μ| = (0, 1, 1): mean 2/3, max 1
    assert m["logp_abs_diff_mean"].item() == pytest.approx(2 / 3) and m["logp_abs_diff_max"].item() == 1.0
    # without weights the raw ratio ρ = (1, e⁻¹, e) is the weight
    m = offpolicy_metrics(train, rollout, mask, prefix="")
    assert m["is_weight_max"].item() == pytest.approx(E) and m["is_weight_min"].item() == pytest.approx(math.exp(-1))


def test_verl_names_equal_verls_own_offpolicy_metrics():
    """Under verl's names, the metrics verl computes too equal verl 0.9's ``compute_offpolicy_metrics`` (on a batch
    whose every sequence has a valid token: verl counts an empty one as PPL 1, we leave it out)."""
    pytest.importorskip("verl")
    from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics

    g = torch.Generator().manual_seed(0)
    train = -3 * torch.rand(6, 11, generator=g)
    rollout = train + 0.3 * torch.randn(6, 11, generator=g)
    mask = torch.rand(6, 11, generator=g) < 0.7
    mask[:, 0] = True
    ours = offpolicy_metrics(train, rollout, mask, naming="verl")
    theirs = compute_offpolicy_metrics(train, rollout, mask.float())
    assert set(theirs) <= {k.removeprefix("rollout_corr/") for k in ours}
    for name, value in theirs.items():
        assert ours[f"rollout_corr/{name}"].item() == pytest.approx(value, rel=1e-5, abs=1e-6), name
