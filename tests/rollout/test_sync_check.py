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


def test_the_baseline_follows_verified_syncs_within_the_envelope():
    # rows of residual 0.005 and 0.015: gap 0.01, se = sd(0.005, 0.015) / √2 = 0.005, threshold
    # 0.01 + 6 · √2 · 0.005 = 0.0524, envelope max(3 · 0.01, 0.0524) = 0.0524. A verified sync at twice the rounding
    # error becomes the baseline (0.02, band 0.02 + 6 · √2 · 0.01 = 0.105); the envelope stays at 0.0524
    check = SyncCheck(z=6.0, max_drift=3.0)
    mask = torch.ones(2, 2, dtype=torch.bool)
    trainer = torch.tensor([[-1.0, -2.0], [-1.5, -0.5]])
    r0 = torch.tensor([[0.005, 0.005], [0.015, 0.015]])
    check.calibrate_from(trainer + r0, trainer, mask)
    assert check.baseline == pytest.approx(0.01) and check.envelope == pytest.approx(0.01 + 6 * math.sqrt(2) * 0.005)
    moved = trainer - 0.5  # the trainer moved far (resolved), the engine with it
    metrics = check.judge_scores(moved + 2 * r0, moved, mask, what="sync 1")
    assert metrics["sync/ok"] == 1.0 and metrics["sync/verified"] == 1.0 and check.baseline == pytest.approx(0.02)
    assert check.baseline + 6 * math.sqrt(2) * check.standard_error == pytest.approx(0.02 + 6 * math.sqrt(2) * 0.01)
    assert check.threshold == pytest.approx(check.envelope)
    with pytest.raises(SyncCheckError, match="sync 2"):  # 0.06: within the new baseline's band, outside the envelope
        check.judge_scores(moved - 1.0 + 6 * r0, moved - 1.0, mask, what="sync 2")


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="z must be"):
        SyncCheck(z=0)
    with pytest.raises(ValueError, match="max_drift"):
        SyncCheck(max_drift=0.5)
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


def test_gap_standard_error_by_hand():
    from offpolicy.rollout.sync_check import gap_standard_error

    # row means of |r|: 0.2, 0.2, 0.1 → sd 0.05774 → / √3 = 0.03333; padding never counts
    r = torch.tensor([[0.1, 0.3, 9.0], [0.2, 0.2, 9.0], [0.0, 0.2, 9.0]])
    mask = torch.tensor([[True, True, False]] * 3)
    assert gap_standard_error(r, mask) == pytest.approx(0.057735 / math.sqrt(3), rel=1e-4)
    one = torch.tensor([[0.1, 0.3, 0.2]])  # one row: the tokens' sd 0.1 / √3
    assert gap_standard_error(one, torch.ones(1, 3, dtype=torch.bool)) == pytest.approx(0.1 / math.sqrt(3), rel=1e-4)


def test_the_text_probe_goes_through_the_users_tokenizer(tiny):
    from offpolicy.rollout.sync_check import PROBE_TEXTS

    _, tok = tiny
    probe = SyncProbe.from_text(tok)
    assert len(probe.prompt_ids) == len(PROBE_TEXTS)
    first = tok(PROBE_TEXTS[0], add_special_tokens=False)["input_ids"][:48]
    assert probe.prompt_ids[0] + probe.completion_ids[0] == first
    assert len(probe.prompt_ids[0]) == len(first) // 4
    with pytest.raises(ValueError, match="text 0"):
        SyncProbe.from_text(tok, ["a"])


def _adam_like_step(model, lr, seed=0):
    """A step of Adam's size under a steady gradient: every weight moves by ±lr, the signs fixed by ``seed`` (the
    same direction step after step, as Adam's normalised update is while the gradient's sign holds)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randint(0, 2, p.shape, generator=gen).float() * 2 - 1, alpha=lr)


@pytest.fixture
def bf16_rig(tiny):
    import copy

    def build(forget: str, dtype: str = "bfloat16"):
        model, tok = copy.deepcopy(tiny[0]), tiny[1]
        engine = _BrokenSync(copy.deepcopy(model), dtype=dtype, tokenizer=tok, forget=forget)
        prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in [(3, 4), (12, 30), (7, 7), (25, 50), (61, 2), (9, 90),
                                                             (44, 11), (8, 19)]]
        out = engine.generate(prompts, SamplingConfig(max_new_tokens=12), seed=0)
        check = SyncCheck(on_failure="warn")
        check.calibrate(engine, model, SyncProbe.from_rollout(out.prompt_ids, out.completion_ids))
        return model, engine, check

    return build


@pytest.mark.parametrize("lr", [1e-6, 1e-5])
def test_a_sync_that_does_nothing_is_caught_at_once_at_a_small_learning_rate(bf16_rig, lr):
    # the engine answers as before, bit for bit, while the trainer moved: the engine-motion test resolves at the
    # first sync even where one step moves the probe far less than the bf16 noise (the staleness β cannot resolve)
    model, engine, check = bf16_rig("everything")
    _adam_like_step(model, lr)
    engine.sync_weights(model)
    metrics = check.after_sync(engine, model, what="sync 1")
    assert metrics["sync/ok"] == 0.0 and metrics["sync/engine_motion"] == 0.0
    assert metrics["sync/step_rms"] < 2 * check.noise_rms  # β alone would have said nothing


@pytest.mark.parametrize("lr", [1e-6, 1e-5, 3e-4])
def test_healthy_syncs_at_small_steps_pass_and_move_the_engine_with_the_trainer(bf16_rig, lr):
    model, engine, check = bf16_rig("nothing")
    for i in range(8):
        _adam_like_step(model, lr)
        engine.sync_weights(model)
        metrics = check.after_sync(engine, model, what=f"sync {i + 1}")
        assert metrics["sync/ok"] == 1.0, metrics
        assert metrics["sync/engine_motion"] > 0 or not metrics["sync/step_rms"] > 0


def test_a_head_left_behind_accumulates_until_it_is_named(bf16_rig):
    # fp32 engine, lr 1e-7: one step moves the probe by ~1e-6 nats; each sync is verified and the baseline follows
    # it, but the head's lag adds up sync after sync until the gap leaves the envelope set at calibration (or the
    # staleness β passes ½, which noise alone cannot: |β| ≤ rms(residual) / rms(step))
    model, engine, check = bf16_rig("head", dtype="float32")
    ratios = []
    for i in range(40):
        _adam_like_step(model, 1e-7)
        engine.sync_weights(model)
        metrics = check.after_sync(engine, model, what=f"sync {i + 1}")
        ratios.append(metrics["sync/ratio"])
        if metrics["sync/ok"] == 0.0:
            break
    assert metrics["sync/ok"] == 0.0, "a head left behind was never caught"
    assert len(ratios) >= 2  # caught once the lag had grown, not at once
    healthy, engine, check = bf16_rig("nothing", dtype="float32")
    for i in range(40):  # the same steps with the head synced: no alarm
        _adam_like_step(healthy, 1e-7)
        engine.sync_weights(healthy)
        assert check.after_sync(engine, healthy, what=f"sync {i + 1}")["sync/ok"] == 1.0


@pytest.fixture
def bf16_policy_rig(tiny):
    """A bf16 policy (the trainer's parameters themselves bf16, as a user loads with ``dtype=torch.bfloat16``) beside
    a bf16 engine: the check scores the trainer in the policy's own dtype."""
    import copy

    def build(forget: str):
        model, tok = copy.deepcopy(tiny[0]).to(torch.bfloat16), tiny[1]
        engine = _BrokenSync(copy.deepcopy(model), dtype="bfloat16", tokenizer=tok, forget=forget)
        prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in [(3, 4), (12, 30), (7, 7), (25, 50), (61, 2), (9, 90)]]
        out = engine.generate(prompts, SamplingConfig(max_new_tokens=8), seed=0)
        check = SyncCheck(on_failure="warn")
        base = check.calibrate(engine, model, SyncProbe.from_rollout(out.prompt_ids, out.completion_ids))
        return model, engine, check, base

    return build


def test_a_bf16_policy_is_scored_in_its_own_dtype_and_its_healthy_syncs_pass(bf16_policy_rig):
    model, engine, check, base = bf16_policy_rig("nothing")
    assert next(model.parameters()).dtype == torch.bfloat16
    # both sides bf16, the same weights: the gap is the two forwards' own differences (KV cache against a full
    # forward), far below a bf16-against-fp32 gap and never the "different models" limit
    assert 0 <= base["sync/baseline"] < check.max_baseline
    for i, lr in enumerate([1e-6, 1e-5, 3e-4, 3e-4]):
        _adam_like_step(model, lr, seed=i)
        engine.sync_weights(model)
        assert check.after_sync(engine, model, what=f"sync {i + 1}")["sync/ok"] == 1.0


def test_a_bf16_policys_sync_that_does_nothing_is_caught(bf16_policy_rig):
    model, engine, check, _ = bf16_policy_rig("everything")
    _adam_like_step(model, 3e-3)  # a step bf16 weights can hold (about half a bf16 ulp of a unit weight is 2e-3)
    engine.sync_weights(model)
    metrics = check.after_sync(engine, model, what="sync 1")
    assert metrics["sync/ok"] == 0.0
