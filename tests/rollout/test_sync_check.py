"""The weight-sync check on the transformers engine (no vLLM needed): a sync that worked passes, one that did not
happen, or left the tied output head behind, fails naming the sync; hand-computed numbers for the two statistics."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.rollout.hf import HFRolloutEngine
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.sync_check import SyncCheck, SyncCheckError, SyncProbe, probe_gap, stale_fraction


def test_probe_gap_by_hand():
    # |−1 − (−1.5)| = 0.5 and |−3 − (−2)| = 1, the padded entry ignored: (0.5 + 1) / 2 = 0.75
    e = torch.tensor([[-1.0, -3.0, 9.0]])
    t = torch.tensor([[-1.5, -2.0, 0.0]])
    assert probe_gap(e, t, torch.tensor([[True, True, False]])) == pytest.approx(0.75)
    assert probe_gap(torch.tensor([[-math.inf]]), torch.tensor([[-1.0]]), torch.tensor([[True]])) == math.inf


def test_stale_fraction_by_hand():
    # n = (−1, −2), o = (−1.5, −2.5): step o − n = (−0.5, −0.5), ‖·‖² = 0.5, rms 0.5.
    # An engine halfway back, e = (−1.25, −2.25): residual (−0.25, −0.25) → Σ r·d = 0.25 → β = 0.5.
    n, o = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.5]])
    mask = torch.tensor([[True, True]])
    assert stale_fraction(torch.tensor([[-1.25, -2.25]]), n, o, mask) == pytest.approx((0.5, 0.5))
    assert stale_fraction(n, n, o, mask)[0] == 0.0  # took the new weights exactly
    assert stale_fraction(o, n, o, mask)[0] == pytest.approx(1.0)  # kept the old ones
    assert math.isnan(stale_fraction(o, n, n, mask)[0])  # no step: no verdict


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=12), st.floats(0.0, 1.0))
def test_stale_fraction_recovers_any_mixture(step, alpha):
    # e = n + α (o − n) exactly ⇒ β = α whatever the step (when it is not zero)
    d = torch.tensor([step])
    if float((d * d).sum()) < 1e-6:
        return
    n = torch.zeros_like(d) - 1.0
    o = n + d
    beta, _ = stale_fraction(n + alpha * d, n, o, torch.ones_like(d, dtype=torch.bool))
    assert beta == pytest.approx(alpha, abs=1e-4)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="z must be"):
        SyncCheck(z=0)
    with pytest.raises(ValueError, match="min_motion"):
        SyncCheck(min_motion=1.0)
    with pytest.raises(ValueError, match="on_failure"):
        SyncCheck(on_failure="ignore")
    with pytest.raises(ValueError, match="max_stale"):
        SyncCheck(max_stale=1.5)
    with pytest.raises(ValueError, match="completion"):
        SyncProbe([[1]], [[]])


class _BrokenSync(HFRolloutEngine):
    """The transformers engine whose sync forgets the tied output head (or everything)."""

    def __init__(self, *args, forget: str, **kwargs):
        self.forget = "nothing"  # the constructor's own first sync loads the model
        super().__init__(*args, **kwargs)
        self.forget = forget

    def sync_weights(self, model):
        if self.forget == "everything":
            return
        head = self.model.lm_head.weight.detach().clone()
        super().sync_weights(model)
        if self.forget == "head":  # untie and keep the old head, as vLLM's CPU backend does on a reload from files
            self.model.lm_head.weight = torch.nn.Parameter(head)


@pytest.fixture
def tiny():
    from offpolicy.models import load_model

    return load_model("tiny")


def _step(model, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen), alpha=scale)


@pytest.mark.parametrize("forget, scale, caught_by", [("nothing", 0.01, None), ("everything", 0.01, "did not take"),
                                                     ("head", 0.05, "nats per token")])
def test_the_check_on_the_transformers_engine(tiny, forget, scale, caught_by):
    import copy

    model, tok = tiny
    engine = _BrokenSync(copy.deepcopy(model), dtype="bfloat16", tokenizer=tok, forget=forget)
    prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in [(3, 4), (12, 30), (7, 7), (25, 50), (61, 2), (9, 90)]]
    out = engine.generate(prompts, SamplingConfig(max_new_tokens=6), seed=0)
    check = SyncCheck()
    base = check.calibrate(engine, model, SyncProbe.from_rollout(out.prompt_ids, out.completion_ids))
    assert 0 < base["sync/baseline"] < 0.05  # bf16 against fp32: a real, small gap
    for step in range(3):
        _step(model, scale, seed=step)
        engine.sync_weights(model)
        if caught_by is None:
            metrics = check.after_sync(engine, model, what=f"step {step + 1}")
            assert metrics["sync/ok"] == 1.0
        else:
            with pytest.raises(SyncCheckError, match=caught_by) as err:
                check.after_sync(engine, model, what=f"step {step + 1}")
            assert str(err.value).startswith("step 1:")
            return


def test_warn_reports_instead_of_raising(tiny, caplog):
    import copy

    model, tok = tiny
    engine = _BrokenSync(copy.deepcopy(model), dtype="float32", tokenizer=tok, forget="everything")
    out = engine.generate([tok("1+2=")["input_ids"]] * 4, SamplingConfig(max_new_tokens=6), seed=1)
    check = SyncCheck(on_failure="warn")
    check.calibrate(engine, model, SyncProbe.from_rollout(out.prompt_ids, out.completion_ids))
    _step(model, 0.01, seed=0)
    engine.sync_weights(model)
    metrics = check.after_sync(engine, model, what="step 1")
    assert metrics["sync/ok"] == 0.0 and "did not take" in caplog.text


def test_different_models_fail_the_calibration(tiny):
    import copy

    model, tok = tiny
    other = copy.deepcopy(model)
    _step(other, 0.05, seed=3)
    engine = HFRolloutEngine(other, dtype="float32", tokenizer=tok)
    out = engine.generate([tok("1+2=")["input_ids"]] * 4, SamplingConfig(max_new_tokens=6), seed=1)
    with pytest.raises(SyncCheckError, match="different models"):
        SyncCheck().calibrate(engine, model, SyncProbe.from_rollout(out.prompt_ids, out.completion_ids))
