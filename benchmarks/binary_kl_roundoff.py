"""Round-off of the binary KL of the sampled token for nearby policies: the textbook form (verl's ``dppo_kl`` with its
additive 1e-8 guard, OpenRLHF 0.11.2's ``binary_kl`` gate with its [1e-6, 1 − 1e-6] clamp) against
:func:`offpolicy.binary.bernoulli_kl`, each against the exact value of its own definition (mpmath, 50 digits).

    python benchmarks/binary_kl_roundoff.py

Grid: q = π_old(y) (DPPO) or μ(y) (the gate) ∈ {1e-7, 1e-5, 1e-3, 0.1, 0.5, 0.9, 1 − 1e-3, 1 − 1e-5, 1 − 1e-7, 1},
log p = log q − Δ with Δ ∈ {±1e-6, ±1e-7, ±1e-8, 0} (where p < 1); inputs in float32 and in bfloat16 (the bf16 inputs are the
float32 ones rounded; the reference is taken on the rounded values, so only the function's round-off is measured).
"Input dtype" runs each form in the dtype it is handed, as the textbook code does; the others cast to float32 first.

Printed per form: the most negative value, how many of the grid's values are < 0, the largest absolute error and the
largest error relative to the exact value (where it is > 1e-30), and the false rejections: DPPO-KL's A > 0 test
(outside iff KL > δ and p > q, a NaN counting as outside) at δ = 0.05 (the default) and at δ = 1e-9, where the exact
value is inside; and the gate's ``[0, δ]`` test at δ = 5e-3 (OpenRLHF's ``stat >= 0 and stat <= δ``; ours tests
``stat <= δ`` only, since the value is ≥ 0 by construction) — every pair is inside that gate.
"""

from __future__ import annotations

import math

import mpmath
import torch

from offpolicy.binary import bernoulli_kl

mpmath.mp.dps = 50
QS = (1e-7, 1e-5, 1e-3, 0.1, 0.5, 0.9, 1 - 1e-3, 1 - 1e-5, 1 - 1e-7, 1.0)
DELTAS = (1e-6, -1e-6, 1e-7, -1e-7, 1e-8, -1e-8, 0.0)
VERL_EPS = 1e-8
OPENRLHF_CLAMP = 1e-6


def textbook_verl(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """verl 0.9's dppo_kl divergence (and this project's before the fix): KL((p_old, ·) ‖ (p, ·)), ε inside the log."""
    p, p_old = torch.exp(logp), torch.exp(old_logp)
    return p_old * (old_logp - logp) + (1 - p_old) * torch.log((1 - p_old + VERL_EPS) / (1 - p + VERL_EPS))


def textbook_openrlhf(rollout_logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """OpenRLHF 0.11.2's gate statistic (models/loss.py, ``is_correction_gating="binary_kl"``), rewritten."""
    p = rollout_logp.exp().clamp(OPENRLHF_CLAMP, 1 - OPENRLHF_CLAMP)
    q = old_logp.exp().clamp(OPENRLHF_CLAMP, 1 - OPENRLHF_CLAMP)
    return p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()


def exact(log_q: float, log_p: float, *, eps_guard: float = 0.0, clamp: float = 0.0) -> float:
    """The definition's exact value at these (already rounded) inputs: KL((q, 1 − q) ‖ (p, 1 − p)) with verl's guard
    (``eps_guard``) or with both probabilities clamped into [clamp, 1 − clamp]."""
    q, p = mpmath.exp(mpmath.mpf(log_q)), mpmath.exp(mpmath.mpf(log_p))
    if clamp:
        lo, hi = mpmath.mpf(clamp), 1 - mpmath.mpf(clamp)
        q, p = min(max(q, lo), hi), min(max(p, lo), hi)
    first = q * mpmath.log(q / p)
    second = (1 - q) * mpmath.log((1 - q + eps_guard) / (1 - p + eps_guard))
    return float(first + second)


def grid(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(log q, log p) over the grid, rounded to ``dtype``."""
    pairs = [(math.log(q), math.log(q) - d) for q in QS for d in DELTAS if math.log(q) - d < 0]  # p < 1
    a, b = [x for x, _ in pairs], [y for _, y in pairs]
    return torch.tensor(a, dtype=torch.float64).to(dtype), torch.tensor(b, dtype=torch.float64).to(dtype)


def report(name: str, values: torch.Tensor, reference: list[float], outside: torch.Tensor) -> dict[str, float]:
    v = values.double()
    ref = torch.tensor(reference, dtype=torch.float64)
    err = (v - ref).abs()
    ok = ~v.isnan()
    big = ok & (ref.abs() > 1e-30)
    row = {
        "min": float(v[ok].min()) if ok.any() else math.nan, "negative": int((v < 0).sum()), "nan": int((~ok).sum()),
        "max_abs_err": float(err[ok].max()) if ok.any() else math.nan,
        "max_rel_err": float((err[big] / ref[big].abs()).max()) if big.any() else math.nan,
        "false_rejections": int(outside.sum()),
    }
    print(f"  {name:<44} min {row['min']:+.3e}  <0: {row['negative']:>2}/{len(v)}  NaN: {row['nan']}  "
          f"max |err| {row['max_abs_err']:.2e}  max rel err {row['max_rel_err']:.2e}  false rejections "
          f"{row['false_rejections']}")
    return row


def main() -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = grid(dtype)  # a = log q (π_old for DPPO, μ for the gate), b = log p
        a32, b32 = a.float(), b.float()
        ref_verl = [exact(x, y, eps_guard=VERL_EPS) for x, y in zip(a32.tolist(), b32.tolist())]
        ref_clamped = [exact(x, y, clamp=OPENRLHF_CLAMP) for x, y in zip(a32.tolist(), b32.tolist())]
        # this project's DPPO clamp: probabilities ≤ 1 − 1e-8 (exact KL of the clamped pair)
        top = float(torch.tensor(math.log1p(-1e-8), dtype=torch.float32))  # the bound as bernoulli_kl rounds it
        ref_ours_dppo = [exact(min(x, top), min(y, top)) for x, y in zip(a32.tolist(), b32.tolist())]
        print(f"{dtype} inputs ({len(a)} pairs; |Δ log p| ≤ 1e-6):")
        pushes_up = b32 > a32  # p > q: an A > 0 update moving further out

        def dppo_outside(kl: torch.Tensor, ref: list[float], pushes_up: torch.Tensor = pushes_up) -> torch.Tensor:
            """Outside the region at δ = 0.05 or at δ = 1e-9 (a NaN compares false: outside) where the exact value
            is inside it: a false "outside the trust region"."""
            exact = torch.tensor(ref, dtype=torch.float64)
            return pushes_up & ((~(kl <= 0.05) & (exact <= 0.05)) | (~(kl <= 1e-9) & (exact <= 1e-9)))

        def gate_rejects(kl: torch.Tensor, lower: bool) -> torch.Tensor:
            inside = kl <= 5e-3
            return ~(inside & (kl >= 0)) if lower else ~inside

        key = str(dtype).replace("torch.", "")
        for label, values, ref, outside in (
            ("verl / old dppo_kl, input dtype", textbook_verl(b, a), ref_verl, None),
            ("verl / old dppo_kl, float32", textbook_verl(b32, a32), ref_verl, None),
            ("offpolicy dppo_kl (bernoulli_kl, max 1-1e-8)", bernoulli_kl(a, b, max_prob=1 - 1e-8), ref_ours_dppo,
             None),
            ("OpenRLHF gate, input dtype", textbook_openrlhf(a, b), ref_clamped, "gate_lower"),
            ("OpenRLHF gate, float32", textbook_openrlhf(a32, b32), ref_clamped, "gate_lower"),
            ("offpolicy gate (bernoulli_kl, [1e-6, 1-1e-6])",
             bernoulli_kl(a, b, min_prob=OPENRLHF_CLAMP, max_prob=1 - OPENRLHF_CLAMP), ref_clamped, "gate"),
        ):
            flags = (dppo_outside(values.float(), ref) if outside is None else
                     gate_rejects(values.float(), lower=outside == "gate_lower"))
            rows[f"{key}: {label}"] = report(label, values, ref, flags)
    return rows


if __name__ == "__main__":
    main()
