"""offpolicy.bounds: TRM bounds (worked example), DVP bias bound on an enumerable MDP, Prop 4.2 envelope."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.bounds import dvp_bias_bound, mismatch_envelope, trm_bounds


def test_trm_worked_example():
    # T = 4096, δ = 1e-4, ε = 5e-3, KL_seq = 0.01, TV_seq = 0.05 (arXiv 2512.23075, "B* ≤ 4.1")
    b = trm_bounds(4096, delta=1e-4, eps=5e-3, kl_seq=0.01, tv_seq=0.05)
    # classical KL: 4096 · 4095 · 1e-4 = 1677.312
    assert round(b["classical_kl"], 1) == 1677.3
    # classical TV: 2 · 4096 · 4095 · 2.5e-5 = 838.656
    assert round(b["classical_tv"], 1) == 838.7
    # coupling: (t−1)ε ≤ 1 for t−1 ≤ 200: Σ = 0.005 · (200·201/2) + (4096 − 201) · 1 = 100.5 + 3895 = 3995.5;
    # 4 · 0.005 · 3995.5 = 79.91
    assert round(b["coupling"], 2) == 79.91
    # PM: √((t−1)·5e-5) < 1 for all t ≤ 4096, so Σ_t min(1, ·) = √(5e-5) Σ_{j<4096} √j. Euler–Maclaurin:
    # Σ √j ≈ ⅔ 4095^{3/2} + ½ √4095 + ζ(−½) = 174 698.67 + 32.00 − 0.21 = 174 730.46 -> × 0.0070711 = 1235.53
    # PM-KL = 4 · 0.0070711 · 1235.53 = 34.946; PM-TV = 4 · 0.005 · 1235.53 = 24.711
    assert sum(math.sqrt(j) for j in range(4096)) == pytest.approx(174_730.46, abs=0.01)
    assert round(b["pinsker_marginal_kl"], 2) == 34.95
    assert round(b["pinsker_marginal_tv"], 2) == 24.71
    # Mixed-KL: 4 · 4096 · √(5e-5) · √(0.005) = 16384 · 0.0070711 · 0.0707107 = 16384 · 5e-4 = 8.192
    assert round(b["mixed_kl"], 3) == 8.192
    # Mixed-TV: 4 · 4096 · 0.005 · 0.05 = 4.096
    assert round(b["mixed_tv"], 3) == 4.096
    assert round(b["unified"], 3) == 4.096
    assert "adaptive" not in b


def test_adaptive_hand_value_and_unified_is_min():
    # T = 3, δ = 0.02, ε = 0.1, D̄ = (0.1, 0.2, 0.3): T − t = 2, 1, 0
    # w_1 = min(1, 0.2, √(2·0.01)=0.1414) = 0.1414; w_2 = min(1, 0.1, √0.01 = 0.1) = 0.1; w_3 = 0
    # adaptive = 4 (0.1 · 0.141421 + 0.2 · 0.1) = 4 · 0.0341421 = 0.136569
    b = trm_bounds(3, delta=0.02, eps=0.1, dbar=[0.1, 0.2, 0.3])
    assert b["adaptive"] == pytest.approx(0.136569, abs=1e-6)
    assert b["unified"] == min(v for k, v in b.items() if k != "unified")


def test_eps_defaults_to_pinsker():
    # δ = 0.02 -> ε = √(0.01) = 0.1; classical TV = 2 · 10 · 9 · 0.01 = 1.8
    b = trm_bounds(10, delta=0.02)
    assert b["classical_tv"] == pytest.approx(1.8)
    assert "mixed_kl" not in b and "mixed_tv" not in b


@settings(max_examples=50, deadline=None)
@given(T=st.integers(1, 300), delta=st.floats(1e-8, 1.0), eps=st.floats(1e-6, 1.0))
def test_bound_orderings(T, delta, eps):
    b = trm_bounds(T, delta=delta, eps=eps, kl_seq=delta * T, tv_seq=min(1.0, eps * T))
    assert all(v >= 0 for v in b.values())
    assert b["unified"] == min(v for k, v in b.items() if k != "unified")
    # PM terms are capped at 1 per step: PM-KL ≤ 4 T √(δ/2)
    assert b["pinsker_marginal_kl"] <= 4 * T * min(1.0, math.sqrt(delta / 2)) + 1e-9


def test_trm_bounds_validation():
    with pytest.raises(ValueError, match="T"):
        trm_bounds(0, delta=0.1)
    with pytest.raises(ValueError, match="delta"):
        trm_bounds(5, delta=-1.0)
    with pytest.raises(ValueError, match="dbar"):
        trm_bounds(3, delta=0.1, dbar=[0.1, 0.2])


# ---- DVP bias bound (Prop 5.5) on an exactly enumerable MDP -------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 100_000), rho=st.sampled_from([0.05, 0.2, 0.5]), scale=st.floats(0.5, 4.0))
def test_dvp_bias_bound_on_enumerable_mdp(seed, rho, scale):
    # Vocabulary 5, horizon 3: every prefix (1 + 5 + 25 = 31 states) has its own logits; all 125 sequences enumerated.
    V, T = 5, 3
    g = torch.Generator().manual_seed(seed)
    states = [()] + [s for t in (1, 2) for s in itertools.product(range(V), repeat=t)]
    logits = {s: torch.randn(V, generator=g, dtype=torch.float64) * scale for s in states}
    reward = {y: float(r) for y, r in zip(itertools.product(range(V), repeat=T), torch.rand(V ** T, generator=g))}
    pi = {s: torch.softmax(z, -1) for s, z in logits.items()}
    safe = {s: z >= z.max() + math.log(rho) for s, z in logits.items()}
    mass = {s: float(pi[s][safe[s]].sum()) for s in states}
    pi_mp = {s: torch.where(safe[s], pi[s], torch.zeros(())) / mass[s] for s in states}

    def value(policy):
        return sum(r * math.prod(float(policy[y[:t]][y[t]]) for t in range(T)) for y, r in reward.items())

    gap = abs(value(pi_mp) - value(pi))
    bound = dvp_bias_bound(1.0, T, min(mass.values()))  # R ∈ [0, 1]
    assert gap <= bound + 1e-12


def test_dvp_bias_bound_hand_value():
    # 2 · 10 · (1 − 0.95) = 1.0
    assert dvp_bias_bound(2.0, 10, 0.95) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="z_min"):
        dvp_bias_bound(1.0, 3, 1.5)


# ---- Prop 4.2 (asymmetric vulnerability) ---------------------------------------------------------------------------

def test_prop_4_2_over_1e5_random_bounded_perturbations():
    g = torch.Generator().manual_seed(0)
    n, V = 100_000, 8
    z = torch.randn(n, V, generator=g, dtype=torch.float64) * torch.rand(n, 1, generator=g, dtype=torch.float64) * 6
    eps_max = torch.rand(n, 1, generator=g, dtype=torch.float64) * 0.5
    e = (torch.rand(n, V, generator=g, dtype=torch.float64) * 2 - 1) * eps_max
    # Half the draws at the cube's corners (|ε_k| = ε_max), where the bound is tightest.
    e[: n // 2] = torch.sign(e[: n // 2]) * eps_max[: n // 2]
    a = torch.randint(0, V, (n, 1), generator=g)
    lp, lp2 = torch.log_softmax(z, -1).gather(1, a)[:, 0], torch.log_softmax(z + e, -1).gather(1, a)[:, 0]
    delta = (lp - lp2).abs()
    p, p2, em = lp.exp(), lp2.exp(), eps_max[:, 0]
    # Rigorous form: 2 ε (1 − p) e^{2ε}
    assert torch.all(delta <= mismatch_envelope(p, em, rigorous=True) + 1e-12)
    # Mean-value form with p at the worse endpoint (log p_a is concave along the segment)
    assert torch.all(delta <= 2 * em * (1 - torch.minimum(p, p2)) + 1e-12)
    # The paper's first-order form holds to first order: violations are O(ε²)
    excess = delta - mismatch_envelope(p, em)
    assert torch.all(excess <= 2 * em * (1 - p) * (torch.exp(2 * em) - 1) + 1e-12)


def test_prop_4_2_first_order_form_can_be_exceeded():
    # ε = −ε_max on a, +ε_max elsewhere: Δ = log(p + (1 − p) e^{2ε}). p = ½, ε = 0.01:
    # log(0.5 + 0.5 · 1.0202013) = log(1.0101007) = 0.0100500 > 2 · 0.01 · 0.5 = 0.01
    z = torch.zeros(2, dtype=torch.float64)
    e = torch.tensor([-0.01, 0.01], dtype=torch.float64)
    delta = (torch.log_softmax(z, -1)[0] - torch.log_softmax(z + e, -1)[0]).abs().item()
    assert delta == pytest.approx(0.0100500, abs=1e-7)
    assert delta > mismatch_envelope(0.5, 0.01)
    assert delta <= mismatch_envelope(0.5, 0.01, rigorous=True)


def test_mismatch_envelope_hand_values():
    # 2 · 0.1 · (1 − 0.25) = 0.15; rigorous × e^{0.2} = 0.15 · 1.221403 = 0.183210
    assert mismatch_envelope(0.25, 0.1) == pytest.approx(0.15)
    assert mismatch_envelope(0.25, 0.1, rigorous=True) == pytest.approx(0.183210, abs=1e-6)
