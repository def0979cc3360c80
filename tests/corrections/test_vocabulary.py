"""corrections.vocabulary: DVP min-p safe sets and constrained log-probs, sampling-support replay."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import chain
from offpolicy.corrections.vocabulary import (
    DEFAULT_RHO,
    constrained_logp,
    coverage_metrics,
    dvp_fields,
    dvp_keep,
    minp_mask_logits,
    minp_safe_set,
    replay_support_logp,
    sampling_support_mask,
)


def test_safe_set_hand_values_and_default_rho():
    # ρ = e^{-2}: threshold = z_max − 2 = 1 − 2 = −1 -> keep 1, 0, −1 (boundary kept), drop −1.5
    z = torch.tensor([1.0, 0.0, -1.0, -1.5])
    assert minp_safe_set(z, rho=math.exp(-2)).tolist() == [True, True, True, False]
    assert DEFAULT_RHO == pytest.approx(2.26e-6, rel=1e-2)


def test_safe_set_keeps_float64_and_agrees_with_constrained_logp_at_the_threshold():
    # token 1 sits 1e-9 below the threshold z_max + log ρ = −13: outside in float64 (float32 would round it onto it)
    z = torch.tensor([[0.0, -13.0 - 1e-9, -1.0]], dtype=torch.float64)
    rho = math.exp(-13)
    assert minp_safe_set(z, rho).tolist() == [[True, False, True]]
    assert constrained_logp(z, torch.tensor([1]), rho).inside.tolist() == [False]


def test_prop_5_6_masked_softmax_is_renormalised_policy_and_gradient_is_contrastive():
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(6, 12, generator=g, dtype=torch.float64) * 3).requires_grad_()
    rho = 0.01
    safe = minp_safe_set(z, rho)
    pi = torch.softmax(z.detach(), -1)
    z_mass = (pi * safe).sum(-1, keepdim=True)
    pi_mp = torch.where(safe, pi / z_mass, torch.zeros(()))
    # Part 1 with −inf (exact) and with the paper's −50 (up to e^{-50} terms).
    torch.testing.assert_close(torch.softmax(minp_mask_logits(z, rho, float("-inf")), -1), pi_mp)
    torch.testing.assert_close(torch.softmax(minp_mask_logits(z, rho), -1), pi_mp, atol=1e-15, rtol=1e-12)
    # Part 2: ∇_z log softmax(z_mp)_a = onehot_a − π^mp (the contrastive form, Prop 5.4) for a in V_S.
    a = pi_mp.argmax(-1)
    lp = torch.log_softmax(minp_mask_logits(z, rho), -1).gather(1, a[:, None]).sum()
    (grad,) = torch.autograd.grad(lp, z)
    torch.testing.assert_close(grad, torch.nn.functional.one_hot(a, 12).double() - pi_mp, atol=1e-12, rtol=0)
    # The same gradient from constrained_logp (exact renormalisation, chunked kernel).
    c = constrained_logp(z, a, rho, memory_budget_bytes=200)
    (grad2,) = torch.autograd.grad(c.logp.sum(), z)
    torch.testing.assert_close(grad2, grad)
    torch.testing.assert_close(c.mass, z_mass[:, 0])


def test_bf16_backward_through_masked_logits_has_no_nan():
    z = (torch.randn(4, 64) * 20).bfloat16().requires_grad_()
    lp = torch.log_softmax(minp_mask_logits(z).float(), -1)[:, 0].sum()
    lp.backward()
    assert torch.isfinite(z.grad.float()).all()


def test_constrained_logp_hand_values():
    # z = (2, 0, −30), ρ = 1e-6 (log ρ = −13.8): token 2 pruned. log π^mp(0) = 2 − log(e² + 1) = 2 − 2.126928 = −0.126928
    # token 2 outside: inside False. Z = (e² + 1)/(e² + 1 + e^{-30}) ≈ 1.
    z = torch.tensor([[2.0, 0.0, -30.0], [2.0, 0.0, -30.0]])
    c = constrained_logp(z, torch.tensor([0, 2]), rho=1e-6)
    assert c.logp[0].item() == pytest.approx(-0.126928, abs=1e-6)
    assert c.inside.tolist() == [True, False]
    assert torch.isfinite(c.logp).all()
    # Temperature 2 halves the logits: (1, 0, −15); threshold 1 − 13.8 = −12.8 still prunes token 2.
    # log π^mp(0) = 1 − log(e + 1) = 1 − 1.313262 = −0.313262
    assert constrained_logp(z, torch.tensor([0, 0]), 1e-6, temperature=2.0).logp[0].item() == pytest.approx(-0.313262, abs=1e-6)


def test_dvp_fields_and_keep_correction_with_a_weight_correction():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2, 3, 10, generator=g) * 4
    roll = z + 0.1 * torch.randn(2, 3, 10, generator=g)
    y = torch.tensor([[0, 1, 2], [3, 4, 5]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    f = dvp_fields(z, y, mask, rho=0.05, rollout_logits=roll)
    train_in = minp_safe_set(z, 0.05).gather(-1, y[..., None])[..., 0]
    roll_in = minp_safe_set(roll, 0.05).gather(-1, y[..., None])[..., 0]
    assert torch.equal(f["extras"]["dvp_keep"], train_in & roll_in & mask.bool())
    b = LogProbBatch(logp=f["logp"], rollout_logp=f["rollout_logp"], mask=mask, extras=f["extras"])
    res = chain(dvp_keep())(b)
    assert torch.equal(res.keep, f["extras"]["dvp_keep"])
    assert "dvp/mass_min" in res.metrics and "dvp/outside_frac" not in res.metrics  # dvp_keep/masked_frac says it
    outside = (mask.bool() & ~f["extras"]["dvp_keep"]).sum() / mask.sum()
    assert res.metrics["dvp_keep/masked_frac"].item() == pytest.approx(outside.item())
    # No key -> identity.
    assert torch.equal(dvp_keep()(LogProbBatch(logp=torch.zeros(1, 2), mask=torch.ones(1, 2))).keep, torch.ones(1, 2).bool())


def test_coverage_metrics_hand_values():
    # valid: masses 0.9, 0.7 -> mean 0.8, min 0.7; inside (T, F) -> outside 0.5
    m = coverage_metrics(torch.tensor([[0.9, 0.7, 0.1]]), torch.tensor([[1, 1, 0]]), torch.tensor([[True, False, False]]))
    assert m["dvp/mass_mean"].item() == pytest.approx(0.8)
    assert m["dvp/mass_min"].item() == pytest.approx(0.7)
    assert m["dvp/outside_frac"].item() == pytest.approx(0.5)


def _hf_support(z, top_k, top_p, min_p, temperature):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = [TemperatureLogitsWarper(temperature)]
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1:
        procs.append(TopPLogitsWarper(top_p))
    if min_p:
        procs.append(MinPLogitsWarper(min_p))
    out = LogitsProcessorList(procs)(torch.zeros(z.shape[0], 1, dtype=torch.long), z.clone())
    return torch.isfinite(out)


@settings(max_examples=50, deadline=None)
@given(v=st.integers(2, 40), top_k=st.one_of(st.none(), st.integers(1, 45)),
       top_p=st.one_of(st.none(), st.floats(0.05, 1.0)), min_p=st.one_of(st.none(), st.floats(0.001, 0.9)),
       temperature=st.sampled_from([0.5, 1.0, 1.5]), seed=st.integers(0, 10_000))
def test_support_matches_huggingface_warpers(v, top_k, top_p, min_p, temperature, seed):
    z = torch.randn(5, v, generator=torch.Generator().manual_seed(seed)) * 3
    ours = sampling_support_mask(z, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature,
                                 order=("top_k", "top_p", "min_p"))
    assert torch.equal(ours, _hf_support(z, top_k, top_p, min_p, temperature))
    assert ours.any(-1).all()  # the argmax always survives


def test_support_order_matters_and_hand_values():
    # z = (3, 2, 1, 0): p = (0.6439, 0.2369, 0.0871, 0.0321).
    z = torch.tensor([3.0, 2.0, 1.0, 0.0])
    # min-p 0.1 first: keep p ≥ 0.0644 -> {0, 1, 2}, renormalised (0.7054, 0.2595, 0.0955); then top-p 0.9:
    # ascending cum (0.0955, 0.3550, 1) -> remove cum ≤ 0.1 -> {0, 1}
    vllm = sampling_support_mask(z, top_p=0.9, min_p=0.1)
    # top-p 0.9 first on the full p: ascending cum (0.0321, 0.1192, 0.3561, 1) -> remove ≤ 0.1 -> {0, 1, 2}; min-p keeps it
    hf = sampling_support_mask(z, top_p=0.9, min_p=0.1, order=("top_k", "top_p", "min_p"))
    assert vllm.tolist() == [True, True, False, False]
    assert hf.tolist() == [True, True, True, False]


def test_replay_support_logp_value_and_gradient():
    # top_k = 2 on (3, 2, 1, 0): support {0, 1}; log π(1) = 2 − log(e³ + e²) = 2 − 3.313262 = −1.313262
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]], requires_grad=True)
    lp, inside = replay_support_logp(z, torch.tensor([1]), top_k=2)
    assert lp.item() == pytest.approx(-1.313262, abs=1e-6) and inside.item()
    lp.sum().backward()
    # ∂/∂z = onehot_1 − π_support = (−0.731059, 1 − 0.268941, 0, 0)
    torch.testing.assert_close(z.grad, torch.tensor([[-0.731059, 0.731059, 0.0, 0.0]]), atol=1e-6, rtol=0)
    _, out = replay_support_logp(z, torch.tensor([3]), top_k=2)
    assert not out.item()


def test_validation_names_arguments():
    z = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="rho"):
        minp_safe_set(z, rho=0.0)
    with pytest.raises(ValueError, match="top_p"):
        sampling_support_mask(z, top_p=0.0)
    with pytest.raises(ValueError, match="order"):
        sampling_support_mask(z, order=("top_k",))
    with pytest.raises(ValueError, match="targets"):
        replay_support_logp(z, torch.zeros(3, dtype=torch.long))


def test_hot_path_functions_compile_fullgraph():
    # No .item(), no Python branch on tensor values: dynamo traces them without a graph break.
    def compiled(fn):
        torch._dynamo.reset()
        return torch.compile(fn, fullgraph=True, backend="eager")

    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(2, 3, 10, generator=g), torch.randint(0, 10, (2, 3), generator=g)
    b = LogProbBatch(logp=torch.zeros(2, 3), mask=torch.ones(2, 3),
                     extras={"dvp_keep": torch.rand(2, 3, generator=g) > 0.3, "dvp_mass": torch.rand(2, 3, generator=g)})
    keep = dvp_keep()
    assert torch.equal(compiled(lambda b: keep(b).keep)(b), keep(b).keep)
    def support(z):
        return sampling_support_mask(z, top_k=3, top_p=0.9, min_p=0.01)

    assert torch.equal(compiled(support)(z), support(z))
    torch.testing.assert_close(compiled(lambda z, y: constrained_logp(z, y, 0.01).logp)(z, y),
                               constrained_logp(z, y, 0.01).logp)


def _top_p_by_full_sort(z, keep, p):
    """Top-p as vLLM and HF write it: sort the whole row ascending, softmax, cumulative sum."""
    masked = torch.where(keep, z, torch.tensor(float("-inf")))
    sorted_z, idx = masked.sort(dim=-1)
    remove = sorted_z.softmax(-1).cumsum(-1) <= 1 - p
    remove[..., -1] = False
    return keep & ~remove.scatter(-1, idx, remove)


@settings(max_examples=60, deadline=None)
@given(v=st.integers(3, 300), k=st.integers(1, 40), p=st.floats(0.05, 0.999), min_p=st.sampled_from([None, 0.05]),
       ties=st.booleans(), seed=st.integers(0, 10_000))
def test_top_p_after_top_k_selects_instead_of_sorting_the_row(v, k, p, min_p, ties, seed):
    # after top-k only the k largest (and ties with the k-th) are left: the top-k selection gives the same support
    # as the full sort; with ties (logits rounded to a coarse grid) the two differ at most on tied tokens, whose
    # order any sort picks arbitrarily
    z = torch.randn(6, v, generator=torch.Generator().manual_seed(seed)) * 3
    if ties:
        z = (z * 2).round() / 2
    k = min(k, v - 1)
    got = sampling_support_mask(z, top_k=k, top_p=p, min_p=min_p)
    keep = sampling_support_mask(z, top_k=k, min_p=min_p)
    want = _top_p_by_full_sort(z, keep, p)
    assert got.any(-1).all() and not (got & ~keep).any()
    if not ties:
        assert torch.equal(got, want)
    else:  # they may differ only on kept tokens tied with another kept token (a sort orders ties arbitrarily)
        tied = keep & (((z[..., :, None] == z[..., None, :]) & keep[..., None, :]).sum(-1) > 1)
        assert not ((got ^ want) & ~tied).any()
