"""Sampling replay's support read off the k largest logits (offpolicy.forward_scores._top_k_support): where top-k
comes before any top-p, the log-prob, the inside flag, the retained mass and the entropy equal, value and gradient,
the full-row filters of :func:`offpolicy.corrections.vocabulary.sampling_support_mask`; a tie with the k-th value,
top-p before top-k and k ≥ V take the full-row path, whose answer is the same."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.corrections.vocabulary import SUPPORT_ORDER, replay_support_logp, sampling_support_mask
from offpolicy.forward_scores import _top_k_support, support_entropy, support_scores
from offpolicy.rollout.sampling import SamplingConfig

HF_ORDER = ("top_k", "top_p", "min_p")


def _full_row(z, y, recipe, order):
    """The reference: the support as a [rows, V] mask of the full row, the log-prob, mass and entropy on it."""
    logp, inside = replay_support_logp(z, y, top_k=recipe.top_k, top_p=recipe.top_p, min_p=recipe.min_p,
                                       temperature=recipe.temperature, order=order)
    support = sampling_support_mask(z.detach(), top_k=recipe.top_k, top_p=recipe.top_p, min_p=recipe.min_p,
                                    temperature=recipe.temperature, order=order)
    lp = (z / recipe.temperature).masked_fill(~support, float("-inf")).log_softmax(-1)
    entropy = -(lp.exp() * lp.masked_fill(~support, 0.0)).sum(-1)
    full = (z.detach() / recipe.temperature).log_softmax(-1).gather(-1, y[:, None])[:, 0]
    return logp, inside, torch.exp(full - logp.detach()).clamp(max=1.0), entropy


def _compare(z, y, recipe, order):
    z = z.clone().requires_grad_()
    logp, inside, mass = support_scores(z, y, recipe, order)
    entropy = support_entropy(z, recipe, order)
    ref_logp, ref_inside, ref_mass, ref_entropy = _full_row(z, y, recipe, order)
    assert torch.equal(inside, ref_inside)
    torch.testing.assert_close((logp, mass, entropy), (ref_logp, ref_mass, ref_entropy), atol=1e-5, rtol=1e-5)
    g = torch.randn(2, len(y), generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((g[0] * logp.masked_fill(~inside, 0) + g[1] * entropy).sum(), z)[0]
    want = torch.autograd.grad((g[0] * ref_logp.masked_fill(~ref_inside, 0) + g[1] * ref_entropy).sum(), z)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    return inside


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 30), p=st.sampled_from([None, 0.5, 0.8, 0.95, 1.0]),
       min_p=st.sampled_from([None, 0.0, 0.02, 0.3]), temperature=st.sampled_from([1.0, 0.7, 1.3]),
       order=st.sampled_from([SUPPORT_ORDER, HF_ORDER]))
def test_the_k_largest_give_the_full_rows_support(seed, k, p, min_p, temperature, order):
    g = torch.Generator().manual_seed(seed)
    z = 3 * torch.randn(12, 40, generator=g)
    y = torch.randint(0, 40, (12,), generator=g)
    y[:4] = z[:4].argmax(-1)  # some targets inside whatever the filters
    recipe = SamplingConfig(top_k=k, top_p=p, min_p=min_p, temperature=temperature)
    assert _top_k_support(z, recipe, order) is not None  # the fast path is the one tested
    _compare(z, y, recipe, order)


def test_the_tested_cases_drop_targets():
    g = torch.Generator().manual_seed(0)
    z, y = 3 * torch.randn(12, 40, generator=g), torch.randint(0, 40, (12,), generator=g)
    y[:4] = z[:4].argmax(-1)
    inside = _compare(z, y, SamplingConfig(top_k=5, top_p=0.9), SUPPORT_ORDER)
    assert 0 < int(inside.sum()) < len(y)


def test_top_p_after_min_p_renormalises_over_min_ps_survivors():
    """z = (2, 1.9, 0.5, 0.4, 0.3, 0, …), vLLM's order, min-p 0.3 then top-k 5 then top-p 0.5: min-p leaves {2, 1.9}
    (threshold 2 + log 0.3 = 0.80); over them π(1.9) = e^1.9 / (e² + e^1.9) = 0.475 ≤ 1 − 0.5, so top-p drops it
    (over all five of the top-k its ascending cumulative mass would be 0.60 and it would stay)."""
    z = torch.tensor([[2.0, 1.9, 0.5, 0.4, 0.3] + [0.0] * 5])
    recipe = SamplingConfig(top_k=5, top_p=0.5, min_p=0.3)
    assert _top_k_support(z, recipe, SUPPORT_ORDER) is not None
    inside = _compare(z, torch.tensor([1]), recipe, SUPPORT_ORDER)
    assert not bool(inside[0])


@pytest.mark.parametrize("case", ["tie", "top_p_first", "k_at_least_v"])
def test_where_the_k_largest_do_not_apply_the_full_row_answers(case):
    g = torch.Generator().manual_seed(2)
    z, y = torch.randn(6, 10, generator=g), torch.randint(0, 10, (6,), generator=g)
    recipe, order = SamplingConfig(top_k=3, top_p=0.9), SUPPORT_ORDER
    if case == "tie":  # row 0: the 3rd and 4th largest equal, both kept by the full-row filter
        z[0] = torch.tensor([5.0, 4.0, 3.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
        y[0] = 3
    elif case == "top_p_first":
        order = ("top_p", "top_k", "min_p")
    else:
        recipe = SamplingConfig(top_k=10, top_p=0.9)
    assert _top_k_support(z, recipe, order) is None
    inside = _compare(z, y, recipe, order)
    if case == "tie":
        assert bool(inside[0])  # the tied 4th token is in the support
