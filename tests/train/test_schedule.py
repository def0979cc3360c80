"""Learning-rate schedules (``optim.schedule``): the rate per step by hand and by property, and in a run."""

import copy
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.train import train
from offpolicy.train.config import load_config
from offpolicy.train.schedule import is_scheduled, lr_at


def _opt(**kw):
    base = dict(lr=1e-3, schedule="constant", warmup_steps=0, step_every=16, step_factor=0.5, min_lr_scale=0.0)
    return SimpleNamespace(**{**base, **kw})


def test_hand_computed_rates():
    # cosine over 4 steps, floor 0.2: 0.2 + 0.8·½(1 + cos(π s/4)) = 1, 0.2 + 0.8·0.85355 = 0.88284, 0.6, 0.31716
    cos = [lr_at(_opt(schedule="cosine", min_lr_scale=0.2), s, 4) for s in range(4)]
    assert cos == pytest.approx([1e-3, 8.8284e-4, 6e-4, 3.1716e-4], rel=1e-4)
    # step: halve every 16 steps, floor 0.05 — the LR guard's trajectory under an engine synced every 8 steps
    step = _opt(schedule="step", min_lr_scale=0.05)
    assert [lr_at(step, s, 100) for s in (0, 15, 16, 32, 48, 64, 80, 99)] == pytest.approx(
        [1e-3, 1e-3, 5e-4, 2.5e-4, 1.25e-4, 6.25e-5, 5e-5, 5e-5])
    # warm-up of 4 steps: (s + 1)/4 of the constant rate, then the rate itself
    assert [lr_at(_opt(warmup_steps=4), s, 10) for s in range(6)] == pytest.approx(
        [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert not is_scheduled(_opt()) and is_scheduled(_opt(warmup_steps=1)) and is_scheduled(_opt(schedule="cosine"))


@settings(max_examples=200, deadline=None)
@given(schedule=st.sampled_from(["constant", "cosine", "step"]), total=st.integers(1, 300),
       warmup=st.integers(0, 50), every=st.integers(1, 40), factor=st.floats(0.05, 0.95),
       floor=st.floats(0.0, 1.0))
def test_rates_are_positive_bounded_and_never_rise_after_warmup(schedule, total, warmup, every, factor, floor):
    if schedule == "step":
        floor = max(floor, 0.01)  # the config requires a floor for step (test_bad_schedule_names_the_key)
    opt = _opt(schedule=schedule, warmup_steps=warmup, step_every=every, step_factor=factor, min_lr_scale=floor)
    rates = [lr_at(opt, s, total) for s in range(total)]
    assert all(0 < r <= opt.lr * (1 + 1e-12) for r in rates)
    after = rates[min(warmup, total):]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(after, after[1:]))
    if schedule == "constant" and warmup == 0:
        assert rates == [opt.lr] * total


def test_a_run_follows_its_schedule_and_the_guard_multiplies_it(tmp_path, tiny_pair, make_overrides, varying_task):
    model0, tok = tiny_pair
    cfg = load_config(None, make_overrides(tmp_path / "a", steps=3, optim__schedule="step", optim__step_every=1,
                                           optim__min_lr_scale=0.01))
    hist = train(cfg, model=copy.deepcopy(model0), tokenizer=tok, task=varying_task()).history
    assert [h["optim/lr"] for h in hist] == pytest.approx([1e-3, 5e-4, 2.5e-4])
    # with the LR guard on (a rise of 1.01× over 2 steps cuts it), each step's rate is the schedule's times the cut
    cfg = load_config(None, make_overrides(tmp_path / "b", "trm", steps=6, optim__schedule="cosine", control__lr_guard="true",
                                           control__lr_guard_window=2, control__lr_guard_rise=1.01,
                                           rollout__weight_bits=2))
    hist = train(cfg, model=copy.deepcopy(model0), tokenizer=tok, task=varying_task()).history
    for s, h in enumerate(hist):
        scale = h["control/lr"] / 1e-3  # the guard's factor this step
        assert h["optim/lr"] == pytest.approx(lr_at(cfg.optim, s, 6) * scale)
    assert hist[0]["optim/lr"] == pytest.approx(1e-3)
    assert any(h["control/lr"] < 0.999e-3 for h in hist)  # the guard did cut: the product is tested, not only ×1


def test_bad_schedule_names_the_key(tmp_path, make_overrides):
    with pytest.raises(ValueError, match="optim.schedule"):
        load_config(None, make_overrides(tmp_path, optim__schedule="linear"))
    with pytest.raises(ValueError, match="optim.min_lr_scale must be > 0 with optim.schedule=step"):
        load_config(None, make_overrides(tmp_path, optim__schedule="step"))
