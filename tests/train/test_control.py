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
    # 2-bit engine weights: a mean token KL around TRM's avg threshold 0.001, so that threshold moves; the sampler of
    # the trajectory on which the guard was measured to act
    extra = {"control__trm_acceptance": 0.7, "control__lr_guard": "true", "control__lr_guard_window": 2,
             "control__lr_guard_rise": 1.01, "control__window": 2, "rollout__weight_bits": 2,
             "rollout__sampler": "multinomial"}
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


# -- DVP's entropy-adaptive safe set (algorithm.dvp_coverage) --------------------------------------------------------


def test_dvp_coverage_config_and_sampling():
    from offpolicy.train.build import sampling_config

    cfg = load_config(None, ["algorithm.preset=dvp_mis", "algorithm.dvp_coverage=0.01"])
    s = sampling_config(cfg)
    assert s.top_p == pytest.approx(0.99) and s.min_p == pytest.approx(math.exp(-13))
    with pytest.raises(ValueError, match="algorithm.dvp_coverage adapts DVP's safe set; preset 'naive'"):
        load_config(None, ["algorithm.dvp_coverage=0.01"])


def test_adaptive_safe_set_keeps_its_mass_and_prunes_more_where_confident():
    from offpolicy.rollout.sampling import SamplingConfig, process_logits
    from offpolicy.train.scoring import dvp_scores

    # row 0 confident: logits (14, 0 × 49) → p₀ = e¹⁴ / (e¹⁴ + 49) = 1 − 4.0e-5 ≥ 1 − ε, so top-p(1 − 1e-3) keeps
    # token 0 alone (Z = 0.99996); row 1 flat: p = 1/50 each, 1 − ε = 0.999 needs all 50 (49 hold only 0.98)
    z = torch.zeros(2, 1, 50)
    z[0, 0, 0] = 14.0
    cfg = SamplingConfig(top_p=1 - 1e-3, min_p=1e-9)
    targets = torch.zeros(2, 1, dtype=torch.long)
    logp, inside, mass = dvp_scores(z, targets, cfg)
    processed = process_logits(z, cfg)
    kept = torch.isfinite(processed).sum(-1)
    assert kept.tolist() == [[1], [50]]
    assert mass[0, 0].item() == pytest.approx(1 - 49 / (math.exp(14) + 49), rel=1e-6)
    assert inside.all()
    assert (mass >= 1 - 1e-3 - 1e-6).all()  # the retained mass never drops below 1 − ε
    # the log-prob is the engine's processing at the target: 0 on row 0 (alone in V_S), log 1/50 on row 1
    torch.testing.assert_close(logp, processed.gather(-1, targets[..., None])[..., 0])
    # a target outside V_S (row 0 keeps token 0 alone) is outside, and the mass is the set's, whatever the target
    _, inside_1, mass_1 = dvp_scores(z, torch.ones(2, 1, dtype=torch.long), cfg)
    assert inside_1.tolist() == [[False], [True]]
    torch.testing.assert_close(mass_1, mass)


def test_fp32_engine_with_the_adaptive_set_is_on_policy(tmp_path, fresh, make_overrides, varying_task):
    # the engine samples from top-p(1 − ε) ∩ min-p(ρ) of its logits, the trainer scores over the same set of its own:
    # with an fp32 engine and no KV cache the two are the same distribution, nothing is dropped
    model, tok = fresh
    cfg = load_config(None, make_overrides(tmp_path, "dvp_mis", steps=2, rollout__dtype="float32",
                                           rollout__kv_cache="false", algorithm__dvp_coverage=0.05))
    hist = train(cfg, model=model, tokenizer=tok, task=varying_task()).history
    assert all(h["rollout_correction/k3_kl"] < 1e-9 and h["correction/masked_frac"] == 0.0 for h in hist)
