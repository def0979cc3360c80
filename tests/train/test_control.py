"""The trainer's closed loop (config ``control``): wiring of the controllers to the chain and the learning rate."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from offpolicy.train import train
from offpolicy.train.config import load_config
from offpolicy.train.control import Control


class FakeState:
    """What Control reads and writes on a TrainState."""

    def __init__(self, specs):
        self.correction_specs = specs
        self.lr_set = []

    def set_corrections(self, specs):
        self.correction_specs = specs

    def set_lr(self, lr):
        self.lr_set.append(lr)


def _cfg(**control):
    return SimpleNamespace(control=SimpleNamespace(**{"trm_acceptance": None, "is_max_masked": None, "window": 1,
                                                      "lr_guard": False, **control}),
                           optim=SimpleNamespace(lr=1e-3))


def test_trm_thresholds_follow_the_measured_divergence():
    state = FakeState([{"name": "trm", "max_kl": 0.05, "avg_kl": 0.001}])
    control = Control(_cfg(trm_acceptance=0.5), state)
    # per-sequence max KL (0.1, 0.2, 0.3, 0.4): Q_0.5 at position 1.5, rounded up → 0.3 > 0.05;
    # per-sequence mean: (0.1+0)/2 … → (0.05, 0.1, 0.15, 0.2): → 0.15 > 0.001
    div = torch.tensor([[0.1, 0.0], [0.2, 0.0], [0.3, 0.0], [0.4, 0.0]])
    mask = torch.ones(4, 2)
    scored = SimpleNamespace(mask=mask, old_logp=torch.zeros(4, 2), rollout_logp=torch.zeros(4, 2),
                             token_divergence=div)
    assert control.metrics() == {"control/trm_max_kl": 0.05, "control/trm_avg_kl": 0.001}
    control.update(state, scored)
    assert state.correction_specs[0]["max_kl"] == pytest.approx(0.3)
    assert state.correction_specs[0]["avg_kl"] == pytest.approx(0.15)
    # padding never counts: a huge divergence at a masked position changes nothing
    div2 = div.clone()
    div2[:, 1] = 100.0
    scored2 = SimpleNamespace(**{**scored.__dict__, "token_divergence": div2, "mask": torch.tensor([[1, 0]] * 4)})
    control.update(state, scored2)  # per-sequence max (0.1 … 0.4) → 0.3; mean over one token → same values → 0.3
    assert state.correction_specs[0]["max_kl"] == pytest.approx(0.3)
    assert state.correction_specs[0]["avg_kl"] == pytest.approx(0.3)


def test_is_band_widens_and_lr_guard_cuts():
    state = FakeState([{"name": "mis", "level": "token"}])
    control = Control(_cfg(is_max_masked=0.25, lr_guard=True, lr_guard_window=2, lr_guard_rise=2.0,
                           lr_guard_factor=0.5, lr_guard_patience=100, lr_guard_min_scale=0.05), state)
    assert control.metrics() == {"control/is_upper": 2.0, "control/lr": 1e-3}  # mis: upper 2, no lower bound
    # log(π_old/μ) = log (1, 2, 4, 8): one-sided budget 0.25 → Q_0.75 of log₂ (0, 1, 2, 3): position 2.25 → 3 → U = 8
    old = torch.log(torch.tensor([[1.0, 2.0, 4.0, 8.0]]))
    scored = SimpleNamespace(mask=torch.ones(1, 4), old_logp=old, rollout_logp=torch.zeros(1, 4),
                             token_divergence=None)
    control.update(state, scored)
    assert state.correction_specs[0]["upper"] == pytest.approx(8.0)
    # k3 of these ratios: mean(ρ − 1 − log ρ); a second step with 4× the log-ratios raises k3 by far more than 2×
    control.update(state, SimpleNamespace(**{**scored.__dict__, "old_logp": old * 4}))
    assert state.lr_set[-1] == pytest.approx(5e-4)  # cut once: 1e-3 × 0.5
    assert control.metrics()["control/lr"] == pytest.approx(5e-4)


def test_control_needs_its_correction():
    with pytest.raises(ValueError, match="control.trm_acceptance needs a trm correction"):
        Control(_cfg(trm_acceptance=0.7), FakeState([{"name": "mis"}]))
    with pytest.raises(ValueError, match="token-level band"):
        Control(_cfg(is_max_masked=0.05), FakeState([{"name": "tis", "level": "geometric"}]))
    assert Control.build(_cfg(), FakeState([])) is None


def test_controlled_run_logs_its_thresholds_and_resumes_exactly(tmp_path, tiny_pair, make_overrides, varying_task):
    model0, tok = tiny_pair
    # 2-bit engine weights: a mean token KL around TRM's avg threshold 0.001, so that threshold moves
    extra = {"control__trm_acceptance": 0.7, "control__lr_guard": "true", "control__lr_guard_window": 2,
             "control__lr_guard_rise": 1.01, "control__window": 2, "rollout__weight_bits": 2}
    straight = train(load_config(None, make_overrides(tmp_path / "a", "trm", steps=4, **extra)),
                     model=copy.deepcopy(model0), tokenizer=tok, task=varying_task())
    hist = straight.history
    assert all("control/trm_max_kl" in h and "control/lr" in h for h in hist)
    assert hist[0]["control/trm_max_kl"] == pytest.approx(0.05) and all(h["control/trm_max_kl"] >= 0.0499 for h in hist)
    assert any(h["control/trm_avg_kl"] > 0.00101 for h in hist)  # relaxed at least once (measured: 0.0013)
    assert any(h["control/lr"] < 0.999e-3 for h in hist)  # the guard acted at least once

    def interrupt(step, metrics):
        if step == 2:
            raise KeyboardInterrupt

    cfg = load_config(None, make_overrides(tmp_path / "b", "trm", steps=4, **extra))
    train(cfg, model=copy.deepcopy(model0), tokenizer=tok, task=varying_task(), on_step_end=interrupt)
    second = train(cfg, model=copy.deepcopy(model0), tokenizer=tok, task=varying_task(), resume=True)
    split = [h for h in second.history]
    for key in ("control/trm_max_kl", "control/trm_avg_kl", "control/lr", "loss/loss"):
        assert [h[key] for h in hist[2:]] == [h[key] for h in split], key
    for (n, a), b in zip(straight.model.named_parameters(), second.model.parameters()):
        assert torch.equal(a, b), n
    assert all(math.isfinite(h["control/lr"]) for h in hist)
