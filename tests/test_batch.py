"""Tests for offpolicy.batch: LogProbBatch validation, fallbacks and helpers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import (
    LogProbBatch,
    check_advantages,
    check_mask,
    check_same_shape,
    check_token_tensor,
    token_advantages,
)


def make(**kw):
    base = dict(logp=torch.zeros(2, 3), mask=torch.ones(2, 3))
    base.update(kw)
    return LogProbBatch(**base)


def test_valid_batch_and_sizes():
    b = make(old_logp=torch.zeros(2, 3), rollout_logp=torch.zeros(2, 3), advantages=torch.zeros(2), token_divergence=torch.zeros(2, 3))
    assert (b.batch_size, b.seq_len) == (2, 3)
    assert b.bool_mask.dtype == torch.bool


@pytest.mark.parametrize("mask", [torch.ones(2, 3), torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)])
def test_mask_dtypes_accepted(mask):
    assert make(mask=mask).bool_mask.all()


def test_behaviour_and_anchor_fallbacks():
    logp = torch.tensor([[-1.0]], requires_grad=True)
    old, roll = torch.tensor([[-2.0]]), torch.tensor([[-3.0]])
    full = LogProbBatch(logp=logp, mask=torch.ones(1, 1), old_logp=old, rollout_logp=roll)
    assert full.behaviour_logp is roll and full.anchor_logp is old
    no_roll = LogProbBatch(logp=logp, mask=torch.ones(1, 1), old_logp=old)
    assert no_roll.behaviour_logp is old  # μ falls back to π_old
    bare = LogProbBatch(logp=logp, mask=torch.ones(1, 1))
    # on-policy fallback: π_θ, detached (the anchor must never carry gradient)
    assert not bare.behaviour_logp.requires_grad and not bare.anchor_logp.requires_grad
    assert bare.anchor_logp.item() == -1.0


def test_token_advantages_broadcast_and_passthrough():
    b = make(advantages=torch.tensor([1, -2]))  # int advantages are cast to float32
    ta = b.token_advantages()
    assert ta.dtype == torch.float32 and ta.tolist() == [[1.0] * 3, [-2.0] * 3]
    per_tok = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert make(advantages=per_tok).token_advantages().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert token_advantages(torch.tensor([2.0]), torch.zeros(1, 2)).tolist() == [[2.0, 2.0]]


def test_token_advantages_missing_names_advantages():
    with pytest.raises(ValueError, match="^advantages"):
        make().token_advantages()


def test_replace_revalidates():
    b = make()
    assert b.replace(old_logp=torch.ones(2, 3)).old_logp.sum().item() == 6.0
    with pytest.raises(ValueError, match="^old_logp"):
        b.replace(old_logp=torch.ones(2, 4))


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        make().logp = torch.ones(2, 3)  # type: ignore[misc]


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(logp=torch.zeros(3)), "logp"),  # 1-D
        (dict(logp=torch.zeros(2, 3, dtype=torch.long)), "logp"),  # not floating
        (dict(logp=[[0.0]]), "logp"),  # not a tensor
        (dict(mask=torch.ones(2, 4)), "mask"),
        (dict(mask=torch.ones(2, 3, dtype=torch.complex64)), "mask"),
        (dict(old_logp=torch.zeros(2, 4)), "old_logp"),
        (dict(rollout_logp=torch.zeros(3, 3)), "rollout_logp"),
        (dict(rollout_logp=torch.zeros(2, 3, dtype=torch.int32)), "rollout_logp"),
        (dict(token_divergence=torch.zeros(2, 2)), "token_divergence"),
        (dict(token_divergence_kind="sampled"), "token_divergence_kind"),
        (dict(advantages=torch.zeros(3)), "advantages"),
        (dict(advantages=torch.zeros(2, 4)), "advantages"),
        (dict(advantages=torch.zeros(2, 3, 1)), "advantages"),
        (dict(advantages=1.0), "advantages"),
    ],
)
def test_bad_fields_raise_naming_the_field(kw, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        make(**kw)


def test_check_helpers_directly():
    with pytest.raises(ValueError, match="^x has shape"):
        check_same_shape("x", torch.zeros(1, 2), "y", torch.zeros(2, 1))
    with pytest.raises(ValueError, match="^x must be 2-D"):
        check_token_tensor("x", torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="no valid token"):
        check_mask(torch.zeros(1, 2), torch.zeros(1, 2), require_valid=True)
    check_mask(torch.tensor([[0, 1]]), torch.zeros(1, 2), require_valid=True)  # one valid token is enough
    with pytest.raises(ValueError, match="^mask has shape .* but log_ratio"):
        check_mask(torch.zeros(1, 3), torch.zeros(1, 2), "log_ratio")
    check_advantages(torch.zeros(2), torch.zeros(2, 5))


FIELDS = ("logp", "mask", "old_logp", "rollout_logp", "token_divergence", "advantages")


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 6),
    st.sampled_from(FIELDS),
    st.lists(st.integers(1, 7), min_size=0, max_size=3),
)
def test_fuzz_wrong_shape_names_the_field(b, t, bad, shape):
    """Exactly one field gets a random shape; if that shape is invalid the error names that field."""
    kw = dict(
        logp=torch.zeros(b, t),
        mask=torch.ones(b, t),
        old_logp=torch.zeros(b, t),
        rollout_logp=torch.zeros(b, t),
        token_divergence=torch.zeros(b, t),
        advantages=torch.zeros(b),
    )
    kw[bad] = torch.zeros(tuple(shape)) if bad != "mask" else torch.ones(tuple(shape))
    valid_shapes = {(b, t)} | ({(b,)} if bad == "advantages" else set())
    if bad == "logp":
        # a wrong logp makes every other field mismatch; the first complaint must still be about logp or mask
        if tuple(shape) in valid_shapes:
            return
        with pytest.raises(ValueError, match="^(logp|mask)"):
            LogProbBatch(**kw)
        return
    if tuple(shape) in valid_shapes:
        LogProbBatch(**kw)
    else:
        with pytest.raises(ValueError, match=f"^{bad}"):
            LogProbBatch(**kw)


# -- non-finite μ: counted, and refused past the limit ------------------------------------------------------------
def _mu_batch(n_bad: int, **kwargs):
    import math

    mu = torch.full((4, 500), -0.5)  # 2000 valid tokens
    mu.view(-1)[torch.arange(n_bad) * 6 + 3] = torch.tensor([math.nan, -math.inf])[torch.arange(n_bad) % 2]
    return LogProbBatch(logp=torch.zeros(4, 500), mask=torch.ones(4, 500), rollout_logp=mu, **kwargs)


def test_nonfinite_rollout_within_the_limit_is_kept_and_past_it_refused(monkeypatch):
    monkeypatch.delenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", raising=False)
    assert _mu_batch(2).max_nonfinite_rollout == 1e-3  # 2 of 2000 = 1e-3: at the limit, kept
    with pytest.raises(ValueError, match=r"rollout_logp: 3 of 2000 valid tokens \(0.15 %\) are NaN / ±inf, in rows "
                                         r"\[0\] \(first at row 0, position 3\), above max_nonfinite_rollout = 0.001.*"
                                         r"LogProbBatch\(max_nonfinite_rollout=...\) / OFFPOLICY_MAX_NONFINITE_ROLLOUT"):
        _mu_batch(3)
    _mu_batch(3, max_nonfinite_rollout=0.01)  # the argument raises the limit
    _mu_batch(300, max_nonfinite_rollout=None)  # None: no limit
    with pytest.raises(ValueError, match=r"in rows \[0, 1, 2, 3\]"):
        _mu_batch(300)
    # masked positions never count: a NaN in the padding is no failure of the engine
    mu = torch.tensor([[-0.5, float("nan")]])
    LogProbBatch(logp=torch.zeros(1, 2), mask=torch.tensor([[1.0, 0.0]]), rollout_logp=mu, max_nonfinite_rollout=0.0)


def test_nonfinite_rollout_limit_from_the_environment(monkeypatch):
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "0.01")
    assert _mu_batch(3).max_nonfinite_rollout == 0.01
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")
    assert _mu_batch(300).max_nonfinite_rollout is None
    for bad in ("2", "lots"):
        monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", bad)
        with pytest.raises(ValueError, match="OFFPOLICY_MAX_NONFINITE_ROLLOUT must be a share in"):
            _mu_batch(0)
    monkeypatch.delenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT")
    with pytest.raises(ValueError, match="max_nonfinite_rollout must be a share in"):
        _mu_batch(0, max_nonfinite_rollout=1.5)


def test_nonfinite_rollout_is_counted_in_the_metrics_and_refused_in_trls_loss_path(monkeypatch):
    from offpolicy.integrations.trl.loss import batch_from_trl_inputs
    from offpolicy.metrics import offpolicy_metrics

    monkeypatch.delenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", raising=False)
    mu = torch.tensor([[-0.5, float("nan"), -float("inf")], [-0.1, -0.2, float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    m = offpolicy_metrics(torch.full((2, 3), -0.3), mu, mask, naming="trl")
    assert m["sampling/nonfinite_rollout_tokens"].item() == 2.0  # the NaN and the −inf of row 0; row 1's is padding
    inputs = {"completion_mask": mask, "advantages": torch.ones(2), "sampling_per_token_logps": mu}
    with pytest.raises(ValueError, match="rollout_logp: 2 of 5 valid tokens"):
        batch_from_trl_inputs(torch.zeros(2, 3), inputs)
