"""Where ``gated_is`` and OpenRLHF 0.11.2's gate (``openrlhf.models.loss.PolicyLoss``, ``is_correction_*``) differ by
design, each on the small constructed batch that docs/methods/importance-sampling.md quotes ("Where they differ by
design"):

1. **round-off beyond nearby policies** — OpenRLHF's float32 textbook binary KL rounds 1 − μ and 1 − π to float32
   (spacing 6e-8 near 1), so at μ ≈ 2.5e-5 it comes out negative for |Δ log p| up to 0.04 and its ``[0, δ]`` test
   drops those tokens; the exact KL here keeps them;
2. **empty rows at sequence level** — OpenRLHF's per-row statistic of an all-padding row is 0/0 = NaN, which fails the
   band, and ``is_filter_ratio`` averages over every row: the empty row counts as filtered; ``masked_seq_frac`` here
   averages over non-empty sequences;
3. **μ(y) = 0 (log μ = −inf) under a divergence gate** — OpenRLHF clamps μ into [1e-6, 1 − 1e-6], so the binary-KL /
   TV statistic is finite, the token can pass, and its weight e^(b − a) is inf (an inf loss); its clip mode clamps the
   inf ratio to the upper bound. Here the log-ratio is non-finite, so the token is dropped at every gating.

Each difference has a test that needs no OpenRLHF (this library's side, against hand-computed numbers) and a live
test that runs OpenRLHF's own ``PolicyLoss`` on the same batch through ``data/openrlhf_gate.py --cases`` (skipped
without ``openrlhf==0.11.2`` at ``$OFFPOLICY_OPENRLHF_PYTHON``, like ``test_gated_openrlhf.py``; CI requires it).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offpolicy import LogProbBatch, gated_is
from offpolicy.corrections.gated import gate, token_statistic

SCRIPT = Path(__file__).parent / "data" / "openrlhf_gate.py"
OPENRLHF_PYTHON = os.environ.get("OFFPOLICY_OPENRLHF_PYTHON", sys.executable)
INF = math.inf
LEVELS = {"token": "token", "seq": "geometric"}
MODES = {"mask": "mask", "clip": "truncate"}

# 1. round-off: μ = e^-10.6 ≈ 2.49e-5 on every token, π_old = μ·e^Δ. The first four Δ come out negative in float32
#    textbook arithmetic (checked live below); the fifth (Δ = 0.03) positive — a control that both sides keep.
ROUNDOFF_LOG_MU = -10.6
ROUNDOFF_DELTAS = (0.01, 0.02, -0.0405, 0.0432, 0.03)
# 2. empty row: row 0 inside the band at every gating, row 1 far outside (ρ = e^2), row 2 all padding
EMPTY_OLD = [[-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]]
EMPTY_ROLLOUT = [[-1.1, -2.0, -0.4], [-3.0, -4.0, -2.5], [-1.0, -1.0, -1.0]]
EMPTY_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
# 3. μ(y_0) = 0: π_old(y_0) = 1e-4; token 1 passes every gate, token 2 is just outside δ = 5e-3 (binary KL 5.7e-3)
NEGINF_OLD = [[math.log(1e-4), -1.0, -0.5]]
NEGINF_ROLLOUT = [[-INF, -1.1, -0.4]]
# and the other non-finite inputs gated.py's docstring describes: log μ = NaN, and log π_old = −inf (μ = 1e-4)
NAN_ROLLOUT = [[math.nan, -1.1, -0.4]]
OLD_NEGINF_OLD, OLD_NEGINF_ROLLOUT = [[-INF, -1.0, -0.5]], [[math.log(1e-4), -1.1, -0.4]]


def _batch(old: list[list[float]], rollout: list[list[float]], mask: list[list[float]]) -> dict[str, list]:
    """A batch in openrlhf_gate.py's layout, evaluated at log π_θ = log π_old with A = −1 (so the loss is the
    coefficients' token mean)."""
    old = torch.tensor(old, dtype=torch.float32).tolist()  # the float32 values both sides see
    return {"old_logp": old, "rollout_logp": rollout, "logp": old, "advantages": [[-1.0] * len(old[0])] * len(old),
            "mask": mask}


def _roundoff_logps() -> tuple[list[list[float]], list[list[float]]]:
    mu = [[ROUNDOFF_LOG_MU] * len(ROUNDOFF_DELTAS)]
    old = [[ROUNDOFF_LOG_MU + d for d in ROUNDOFF_DELTAS]]
    return torch.tensor(old).tolist(), torch.tensor(mu).tolist()


SCAN = torch.linspace(-0.05, 0.05, 4001)  # the docs' scan: Δ log p evenly spaced, μ = e^-10.6 on every token


def _scan_logps() -> tuple[list[list[float]], list[list[float]]]:
    mu = torch.full((1, len(SCAN)), ROUNDOFF_LOG_MU)
    return (mu + SCAN).tolist(), mu.tolist()


INPUTS = {
    "roundoff": _batch(*_roundoff_logps(), [[1.0] * len(ROUNDOFF_DELTAS)]),
    "scan": _batch(*_scan_logps(), [[1.0] * len(SCAN)]),
    "empty": _batch(EMPTY_OLD, EMPTY_ROLLOUT, EMPTY_MASK),
    "neginf": _batch(NEGINF_OLD, NEGINF_ROLLOUT, [[1.0, 1.0, 1.0]]),
    "nan": _batch(NEGINF_OLD, NAN_ROLLOUT, [[1.0, 1.0, 1.0]]),
    "old_neginf": _batch(OLD_NEGINF_OLD, OLD_NEGINF_ROLLOUT, [[1.0, 1.0, 1.0]]),
}
CASES = [  # (batch, OpenRLHF level, mode, gating, threshold)
    ("roundoff", "token", "mask", "binary_kl", [0.0, 5e-3]),
    ("scan", "token", "mask", "binary_kl", [0.0, 5e-3]),
    ("empty", "seq", "mask", "ratio", [0.5, 5.0]),
    ("empty", "seq", "mask", "binary_kl", [0.0, 0.1]),
    ("empty", "seq", "mask", "tv", [0.0, 0.1]),
    ("neginf", "token", "mask", "binary_kl", [0.0, 5e-3]),
    ("neginf", "token", "mask", "tv", [0.0, 0.05]),
    ("neginf", "seq", "mask", "binary_kl", [0.0, 5e-3]),
    ("neginf", "token", "mask", "ratio", [0.5, 5.0]),
    ("neginf", "token", "clip", "ratio", [0.5, 5.0]),
    ("nan", "token", "mask", "binary_kl", [0.0, 5e-3]),
    ("nan", "token", "clip", "ratio", [0.5, 5.0]),
    ("old_neginf", "token", "mask", "binary_kl", [0.0, 5e-3]),
]


def _tensors(name: str) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in INPUTS[name].items()}



def is_filter_ratio(metrics: dict, level: str) -> float:
    """OpenRLHF's ``is_filter_ratio`` in offpolicy's names: the share of units masked or capped — valid tokens
    (``masked_frac + capped_frac``; only clip mode caps) or, at OpenRLHF's ``seq`` level, sequences."""
    if level == "seq":
        return metrics["gated_is/masked_seq_frac"].item()
    return metrics["gated_is/masked_frac"].item() + metrics["gated_is/capped_frac"].item()


def _ours(name: str, level: str, mode: str, gating: str, threshold: list[float]):
    """gated_is at OpenRLHF's setting on batch ``name``, at log π_θ = log π_old: (coefficient [B, T], its
    is_filter_ratio)."""
    x = _tensors(name)
    low, high = threshold
    correction = gated_is(level=LEVELS[level], mode=MODES[mode], gating=gating, lower=low, upper=high)
    mask = x["mask"].bool()
    result = correction(LogProbBatch(logp=x["old_logp"], old_logp=x["old_logp"], rollout_logp=x["rollout_logp"],
                                     mask=mask, advantages=-torch.ones(mask.shape[0])))
    return result.coefficient, is_filter_ratio(result.metrics, level)


def _exact_binary_kl(log_mu: float, log_pi: float) -> float:
    """KL((μ, 1 − μ) ‖ (π, 1 − π)) in float64 with log1p (no cancellation at these magnitudes): the reference."""
    mu, pi = math.exp(log_mu), math.exp(log_pi)
    return mu * (log_mu - log_pi) + (1 - mu) * (math.log1p(-mu) - math.log1p(-pi))


# ---------------------------------------------------------------------------------------------------------------------
# This library's side (no OpenRLHF)
# ---------------------------------------------------------------------------------------------------------------------


def test_roundoff_batch_exact_kl_keeps_every_token():
    x = _tensors("roundoff")
    kl = token_statistic(x["rollout_logp"], x["old_logp"], "binary_kl")[0]
    reference = torch.tensor([_exact_binary_kl(a, b) for a, b in zip(x["rollout_logp"][0].tolist(),
                                                                     x["old_logp"][0].tolist())],
                             dtype=torch.float64)
    assert bool((kl > 0).all()), kl
    torch.testing.assert_close(kl.double(), reference, rtol=1e-5, atol=0.0)  # 1.25e-9 … 2.4e-8
    assert float(reference.max()) < 3e-8  # far inside δ = 5e-3: a gate at any δ ≥ 3e-8 keeps them all
    coef, filter_frac = _ours("roundoff", "token", "mask", "binary_kl", [0.0, 5e-3])
    assert filter_frac == 0.0
    torch.testing.assert_close(coef, (x["old_logp"] - x["rollout_logp"]).exp())  # every token keeps its own ρ_t


def test_empty_row_is_not_a_filtered_sequence():
    for gating, threshold in (("ratio", [0.5, 5.0]), ("binary_kl", [0.0, 0.1]), ("tv", [0.0, 0.1])):
        coef, filter_frac = _ours("empty", "seq", "mask", gating, threshold)
        assert filter_frac == 0.5, gating  # row 1 of the two non-empty rows; the all-padding row 2 is no unit
        assert bool((coef[0] > 0).all()) and bool((coef[1:] == 0).all()), gating
    g = gate(torch.tensor(EMPTY_ROLLOUT), torch.tensor(EMPTY_OLD), torch.tensor(EMPTY_MASK), level="geometric")
    assert g.unit_valid.squeeze(-1).tolist() == [True, True, False]
    assert g.filtered.squeeze(-1).tolist() == [False, True, False]


def test_zero_rollout_probability_is_dropped_at_every_gating(monkeypatch):
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")  # non-finite μ on purpose: the paths past the limit
    x = _tensors("neginf")
    # the clamped divergence of the −inf token is finite (it is what OpenRLHF gates on): KL((1e-6, ·) ‖ (1e-4, ·))
    # = 1e-6·ln(1e-2) + (1 − 1e-6)·ln((1 − 1e-6)/(1 − 1e-4)) = 9.442e-5, and |1e-6 − 1e-4| = 9.9e-5, both under δ ...
    kl = token_statistic(x["rollout_logp"], x["old_logp"], "binary_kl")[0, 0].item()
    tv = token_statistic(x["rollout_logp"], x["old_logp"], "tv")[0, 0].item()
    assert kl == pytest.approx(1e-6 * math.log(1e-2) + (1 - 1e-6) * math.log((1 - 1e-6) / (1 - 1e-4)), rel=1e-5)
    assert tv == pytest.approx(1e-4 - 1e-6, rel=1e-5)
    # ... but the log-ratio b − a = +inf is undefined, so the gate drops the token (its sequence at sequence level)
    expected = {  # (level, mode, gating, threshold) → (coefficient, filter_frac)
        ("token", "mask", "binary_kl", (0.0, 5e-3)): ([0.0, math.exp(0.1), 0.0], 2 / 3),
        ("token", "mask", "tv", (0.0, 0.05)): ([0.0, math.exp(0.1), 0.0], 2 / 3),
        ("seq", "mask", "binary_kl", (0.0, 5e-3)): ([0.0, 0.0, 0.0], 1.0),
        ("token", "mask", "ratio", (0.5, 5.0)): ([0.0, math.exp(0.1), math.exp(-0.1)], 1 / 3),
        ("token", "clip", "ratio", (0.5, 5.0)): ([0.0, math.exp(0.1), math.exp(-0.1)], 1 / 3),
    }
    for (level, mode, gating, threshold), (want_coef, want_frac) in expected.items():
        coef, filter_frac = _ours("neginf", level, mode, gating, list(threshold))
        assert bool(coef.isfinite().all()), (level, mode, gating)
        torch.testing.assert_close(coef[0], torch.tensor(want_coef), rtol=1e-6, atol=0.0)
        assert filter_frac == pytest.approx(want_frac, abs=1e-7), (level, mode, gating)
    g = gate(x["rollout_logp"], x["old_logp"], x["mask"], gating="binary_kl")
    assert g.finite[0].tolist() == [False, True, True] and g.unit_defined[0].tolist() == [False, True, True]
    assert g.statistic[0, 0].item() == 0.0 and g.filtered[0, 0].item()  # not the clamped 9.4e-5: no statistic


# ---------------------------------------------------------------------------------------------------------------------
# Both sides, live
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def openrlhf() -> dict[tuple, dict]:
    """OpenRLHF's records for CASES, keyed by the case, from ``data/openrlhf_gate.py --cases`` run now."""
    if not Path(OPENRLHF_PYTHON).is_file():
        pytest.skip(f"no Python at OFFPOLICY_OPENRLHF_PYTHON={OPENRLHF_PYTHON} to run openrlhf 0.11.2")
    probe = subprocess.run([OPENRLHF_PYTHON, "-c", "import importlib.metadata as m; print(m.version('openrlhf'))"],
                           capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != "0.11.2":
        pytest.skip(f"{OPENRLHF_PYTHON} has no openrlhf 0.11.2 (pip install --no-deps openrlhf==0.11.2; "
                    f"{(probe.stdout or probe.stderr).strip()[-200:]})")
    request = json.dumps({"inputs": INPUTS, "cases": CASES})  # −inf travels as JSON's -Infinity
    out = subprocess.run([OPENRLHF_PYTHON, str(SCRIPT), "--cases"], input=request, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    records = json.loads(out.stdout)["cases"]
    return {(r["batch"], r["level"], r["mode"], r["gating"]): r for r in records}


def test_live_roundoff_drops_tokens_up_to_four_hundredths_apart(openrlhf, monkeypatch):
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")  # non-finite μ on purpose: the paths past the limit
    there = openrlhf[("roundoff", "token", "mask", "binary_kl")]
    coef, filter_frac = _ours("roundoff", "token", "mask", "binary_kl", [0.0, 5e-3])
    rho = [math.exp(d) for d in (torch.tensor(INPUTS["roundoff"]["old_logp"][0]).double() - ROUNDOFF_LOG_MU).tolist()]
    # OpenRLHF drops the four tokens whose float32 KL is negative, Δ = 0.01, 0.02, −0.0405, 0.0432, keeps the fifth
    assert there["coef"][0][:4] == [0.0] * 4
    assert there["coef"][0][4] == pytest.approx(rho[4], rel=1e-6)
    assert there["is_filter_ratio"] == pytest.approx(0.8, abs=1e-7)
    # here every token is kept with its own ρ_t
    assert filter_frac == 0.0
    torch.testing.assert_close(coef[0].double(), torch.tensor(rho, dtype=torch.float64), rtol=1e-6, atol=0.0)
    assert max(abs(math.log(r)) for r in rho[:4]) > 0.04
    # the docs' scan at the same μ: OpenRLHF drops 928 of 4,001 tokens with |Δ| ≤ 0.05 (the count may move by a few
    # where another CPU's float32 exp rounds π differently), out to |Δ| 0.048; here none
    there = openrlhf[("scan", "token", "mask", "binary_kl")]
    x = _tensors("scan")
    delta = (x["old_logp"] - x["rollout_logp"])[0]
    dropped = torch.tensor(there["coef"][0]) == 0
    assert 850 <= int(dropped.sum()) <= 1000, int(dropped.sum())
    assert float(delta[dropped].abs().max()) > 0.045
    coef, filter_frac = _ours("scan", "token", "mask", "binary_kl", [0.0, 5e-3])
    assert filter_frac == 0.0 and bool((coef > 0).all())
    print(f"OpenRLHF drops {int(dropped.sum())} of {len(SCAN)}, up to |Δ| {float(delta[dropped].abs().max()):.4f}")


def test_live_empty_row_counts_as_filtered_there(openrlhf, monkeypatch):
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")  # non-finite μ on purpose: the paths past the limit
    for gating, threshold in (("ratio", [0.5, 5.0]), ("binary_kl", [0.0, 0.1]), ("tv", [0.0, 0.1])):
        there = openrlhf[("empty", "seq", "mask", gating)]
        coef, filter_frac = _ours("empty", "seq", "mask", gating, threshold)
        assert there["is_filter_ratio"] == pytest.approx(2 / 3, abs=1e-7), gating  # rows 1 and 2 of three
        assert filter_frac == 0.5, gating  # row 1 of the two non-empty rows
        # the loss sees no difference: the same coefficient on every valid token
        mask = _tensors("empty")["mask"].bool()
        torch.testing.assert_close(coef[mask], torch.tensor(there["coef"])[mask], rtol=1e-6, atol=1e-7)


def test_live_zero_rollout_probability_weighs_inf_there(openrlhf, monkeypatch):
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")  # non-finite μ on purpose: the paths past the limit
    rho1, rho2 = math.exp(0.1), math.exp(-0.1)
    cases = {  # OpenRLHF's coefficient and is_filter_ratio; this library's as in the test without OpenRLHF
        ("token", "mask", "binary_kl", (0.0, 5e-3)): ([INF, rho1, 0.0], 1 / 3),
        ("token", "mask", "tv", (0.0, 0.05)): ([INF, rho1, 0.0], 1 / 3),
        ("seq", "mask", "binary_kl", (0.0, 5e-3)): ([INF, rho1, rho2], 0.0),
        ("token", "mask", "ratio", (0.5, 5.0)): ([0.0, rho1, rho2], 1 / 3),  # here the two agree
        ("token", "clip", "ratio", (0.5, 5.0)): ([5.0, rho1, rho2], 1 / 3),  # clamp(inf, 0.5, 5) = 5
    }
    for (level, mode, gating, threshold), (want_coef, want_frac) in cases.items():
        there = openrlhf[("neginf", level, mode, gating)]
        assert there["coef"][0] == pytest.approx(want_coef, rel=1e-6), (level, mode, gating)
        assert there["is_filter_ratio"] == pytest.approx(want_frac, abs=1e-7), (level, mode, gating)
        coef, _ = _ours("neginf", level, mode, gating, list(threshold))
        assert coef[0, 0].item() == 0.0 and bool(coef.isfinite().all()), (level, mode, gating)
    # an inf coefficient makes OpenRLHF's loss inf (here: finite)
    assert openrlhf[("neginf", "token", "mask", "binary_kl")]["loss"] == INF


def test_live_other_nonfinite_inputs(openrlhf, monkeypatch):
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")  # non-finite μ on purpose: the paths past the limit
    rho1 = math.exp(0.1)
    # log μ = NaN: OpenRLHF's NaN statistic fails the band in mask mode (as here: dropped) ...
    there = openrlhf[("nan", "token", "mask", "binary_kl")]
    assert there["coef"][0] == pytest.approx([0.0, rho1, 0.0], rel=1e-6)
    assert there["is_filter_ratio"] == pytest.approx(2 / 3, abs=1e-7)
    coef, filter_frac = _ours("nan", "token", "mask", "binary_kl", [0.0, 5e-3])
    assert coef[0].tolist() == pytest.approx([0.0, rho1, 0.0], rel=1e-6) and filter_frac == pytest.approx(2 / 3)
    # ... and in clip mode becomes the coefficient (here: dropped)
    assert math.isnan(openrlhf[("nan", "token", "clip", "ratio")]["coef"][0][0])
    assert _ours("nan", "token", "clip", "ratio", [0.5, 5.0])[0][0, 0].item() == 0.0
    # log π_old = −inf under the binary-KL gate: OpenRLHF's clamped statistic passes, with weight e^(−inf) = 0, so the
    # coefficients agree but it is not counted as filtered there (here it is: its log-ratio is undefined)
    there = openrlhf[("old_neginf", "token", "mask", "binary_kl")]
    coef, filter_frac = _ours("old_neginf", "token", "mask", "binary_kl", [0.0, 5e-3])
    assert there["coef"][0] == pytest.approx([0.0, rho1, 0.0], rel=1e-6)
    assert coef[0].tolist() == pytest.approx([0.0, rho1, 0.0], rel=1e-6)
    assert there["is_filter_ratio"] == pytest.approx(1 / 3, abs=1e-7) and filter_frac == pytest.approx(2 / 3)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
