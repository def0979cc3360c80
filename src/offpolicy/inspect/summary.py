"""The numbers of an inspection: :func:`summarize` turns :class:`~offpolicy.inspect.measurements.Measurements` into
the JSON-ready dict that ``report.json`` holds (the keys are listed in :mod:`offpolicy.inspect.report`); a value
that could not be measured is ``None``, never a made-up number.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import offpolicy as op
from offpolicy.inspect.depth import depth_summary
from offpolicy.inspect.layers import LAYER_THRESHOLD, first_divergent, layer_shares
from offpolicy.inspect.measurements import HEAD_P, TAIL_P, Measurements
from offpolicy.inspect.recommend import preset_effects, recommend
from offpolicy.inspect.routing_flips import beside_summary, routing_summary

REPORT_VERSION = 1
SAMPLED_TAIL_P = 1e-2  # Prop. 4.3's "tail" for sampled tokens: π < 1%


def _f(x: Any) -> float | None:
    """A finite float, or None (JSON has no NaN/inf)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask].double()



def summarize(measured: Measurements) -> dict[str, Any]:
    """All report numbers as a JSON-ready dict (keys: module docstring and below).

    Beyond the stable keys: ``kl_source`` ("exact", "topk lower bound" or "k3 of the sampled token"), ``kl_median``,
    ``kl_p99`` (the mean is carried by a heavy tail of positions),
    ``kl_reverse_mean``, ``tv_max``, ``topk_overlap_mean``, ``sampled_abs_delta_mean/max`` (|log π − log μ| of the
    sampled tokens), ``tail_head_source`` ("vocabulary" or "sampled tokens"), ``envelope`` (Prop. 4.2 counts),
    ``sampled_tail`` (Prop. 4.3), ``pearson_r``, ``ess``, ``chi2_token``, ``chi2_seq``, ``k3_kl``,
    ``largest_share_layer``, ``layer_threshold``, ``routing`` (mixture-of-experts models: routing flips,
    :func:`offpolicy.inspect.routing_flips.routing_summary`), ``beside`` (another model measured with the same
    engines, and this one's KL and k3 over it, :func:`offpolicy.inspect.routing_flips.beside_summary`), ``presets`` (each correction at its defaults), ``dvp_grid`` (retained
    mass and kept tokens at every ρ of the grid), ``by_position`` (the mismatch per position bin,
    :func:`offpolicy.inspect.depth.depth_summary`), ``checks``, ``meta``.
    """
    t = measured.tokens
    m = t.mask
    n = int(m.sum())
    r = t.log_ratio[m].double()
    finite = torch.isfinite(r)
    out: dict[str, Any] = {"report_version": REPORT_VERSION, "positions": n, "sequences": int(m.any(-1).sum())}
    kl = None if t.kl is None else _masked(t.kl, m)
    if kl is not None:
        out["kl_source"] = "exact" if t.kl_kind == "exact" else "topk lower bound"
    else:  # no distribution: the k3 estimator of KL(μ‖π) from the sampled tokens (unbiased under μ)
        kl, out["kl_source"] = op.k3(t.log_ratio)[m].double(), "k3 of the sampled token"
    out["kl_mean"] = _f(kl.mean()) if n else 0.0
    out["kl_max"] = _f(kl.max()) if n else 0.0
    # the mean is carried by a few positions (a heavy tail); the median and the 99th percentile show the typical one
    out["kl_median"] = _f(kl.median()) if n else 0.0
    out["kl_p99"] = _f(torch.quantile(kl[torch.isfinite(kl)], 0.99)) if n and bool(torch.isfinite(kl).any()) else None
    out["kl_nonfinite_positions"] = int((~torch.isfinite(kl)).sum())
    out["kl_upper_mean"] = _f(_masked(t.kl_upper, m).mean()) if t.kl_upper is not None and n else None
    out["kl_reverse_mean"] = _f(_masked(t.kl_reverse, m).mean()) if t.kl_reverse is not None and n else None
    out["tv_mean"] = _f(_masked(t.tv, m).mean()) if t.tv is not None and n else None
    out["tv_max"] = _f(_masked(t.tv, m).max()) if t.tv is not None and n else None
    out["topk_overlap_mean"] = _f(_masked(t.topk_overlap, m).mean()) if t.topk_overlap is not None and n else None
    out["sampled_abs_delta_mean"] = _f(r[finite].abs().mean()) if bool(finite.any()) else None
    out["sampled_abs_delta_max"] = _f(r[finite].abs().max()) if bool(finite.any()) else None
    out["sampled_nonfinite"] = int((~finite).sum())
    out.update(_tail_head(measured))
    out["sampled_tail"] = _sampled_tail(measured)
    p_train, p_infer = t.trainer_logp[m].double().exp(), t.rollout_logp[m].double().exp()
    ok = torch.isfinite(p_train) & torch.isfinite(p_infer)
    out["pearson_r"] = _f(torch.corrcoef(torch.stack([p_train[ok], p_infer[ok]]))[0, 1]) if int(ok.sum()) > 1 else None
    metrics = op.offpolicy_metrics(t.trainer_logp, t.rollout_logp, m, prefix="")
    for key in ("ess", "chi2_token", "chi2_seq", "k3_kl"):
        out[key] = _f(metrics[key])
    out.update(_layers(measured))
    out["recommended"] = recommend(measured)
    out["dvp_grid"] = _dvp_grid(measured)
    out["presets"] = preset_effects(t)
    out["by_position"] = depth_summary(measured)
    out["routing"] = (None if measured.routing is None
                      else routing_summary(measured.routing, m, t.kl if t.kl_kind == "exact" else None, t.kl_reverse))
    out["beside"] = beside_summary(out, measured.meta.get("beside"))
    out["checks"] = {
        "capture_max_abs_error": measured.meta.get("capture_max_abs_error"),
        "corrected_envelope_violations": None if measured.vocab is None else measured.vocab.corrected_violations,
    }
    out["meta"] = {k: v for k, v in measured.meta.items()}
    return _json_ready(out)


def _tail_head(measured: Measurements) -> dict[str, Any]:
    v = measured.vocab
    if v is not None:
        eps = measured.tokens.eps_max
        eps_v = eps[measured.tokens.mask].double() if eps is not None else torch.zeros(0)
        return {
            "tail_head_ratio": _f(v.tail_head_ratio), "tail_head_source": "vocabulary",
            "tail_abs_delta_mean": _f(v.tail_abs_delta / v.tail_count) if v.tail_count else None,
            "head_abs_delta_mean": _f(v.head_abs_delta / v.head_count) if v.head_count else None,
            "envelope": {
                "pairs": v.pairs, "skipped_positions": v.skipped_rows, "paper_violations": v.paper_violations,
                "paper_violation_fraction": v.paper_violations / v.pairs if v.pairs else 0.0,
                "corrected_violations": v.corrected_violations,
                "eps_max_mean": _f(eps_v.mean()) if eps_v.numel() else None,
                "eps_max_max": _f(eps_v.max()) if eps_v.numel() else None,
            },
        }
    t = measured.tokens
    p = t.trainer_logp[t.mask].double().exp()
    d = t.log_ratio[t.mask].double().abs()
    ok = torch.isfinite(d)
    head, tail = ok & (p > HEAD_P), ok & (p < TAIL_P)
    ratio = None
    if bool(head.any()) and bool(tail.any()) and float(d[head].mean()) > 0:
        ratio = float(d[tail].mean() / d[head].mean())
    return {"tail_head_ratio": ratio, "tail_head_source": "sampled tokens",
            "tail_abs_delta_mean": _f(d[tail].mean()) if bool(tail.any()) else None,
            "head_abs_delta_mean": _f(d[head].mean()) if bool(head.any()) else None, "envelope": None}


def _sampled_tail(measured: Measurements) -> dict[str, Any]:
    """DVP Prop. 4.3 on sampled tokens with π < 1 %: the mean of Δ = log π − log μ and how often it is negative."""
    t = measured.tokens
    p = t.trainer_logp[t.mask].double().exp()
    d = t.log_ratio[t.mask].double()
    sel = torch.isfinite(d) & (p < SAMPLED_TAIL_P)
    count = int(sel.sum())
    return {"p_below": SAMPLED_TAIL_P, "count": count, "mean_delta": _f(d[sel].mean()) if count else None,
            "frac_negative": _f((d[sel] < 0).double().mean()) if count else None}


def _dvp_grid(measured: Measurements) -> list[dict[str, float]] | None:
    """DVP at every ρ of the grid: the trainer's retained mass (min, mean) and the sampled tokens inside both sets."""
    g = measured.dvp
    if g is None or g.mass.numel() == 0:
        return None
    inside = g.inside_trainer & (g.inside_rollout if g.inside_rollout is not None else g.inside_trainer)
    return [{"rho": rho, "log_rho": math.log(rho), "mass_min": float(g.mass[:, j].min()),
             "mass_mean": float(g.mass[:, j].double().mean()), "kept_fraction": float(inside[:, j].double().mean())}
            for j, rho in enumerate(g.rhos)]


def _layers(measured: Measurements) -> dict[str, Any]:
    if not measured.layers:
        return {"layers": None, "first_divergent_layer": None, "largest_share_layer": None,
                "layer_threshold": measured.layer_threshold}
    threshold = measured.layer_threshold if measured.layer_threshold is not None else LAYER_THRESHOLD
    shares = layer_shares(measured.layers)
    largest = max(range(len(shares)), key=lambda i: shares[i]) if any(shares) else None
    return {
        "layers": [{"name": layer.name, "rel_error": layer.rel_error, "share": s}
                   for layer, s in zip(measured.layers, shares)],
        "first_divergent_layer": first_divergent(measured.layers, threshold),
        "largest_share_layer": None if largest is None else measured.layers[largest].name,
        "layer_threshold": threshold,
    }


def _json_ready(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_ready(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _json_ready(x.tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    return x


def headline(summary: dict) -> str:
    """One line naming the two engines (or the dump) and the mean KL(μ‖π): the overview's title and the page's."""
    meta = summary.get("meta") or {}
    if meta.get("formats"):  # a dump read by diagnose: no engines to name
        kl = summary.get("kl_mean")
        what = f"{'/'.join(sorted(set(meta['formats'])))} dump, {summary.get('positions')} tokens"
        return f"{what}:  mean KL(μ‖π) = {kl:.3g} ({summary.get('kl_source')})" if kl is not None else what
    roll = (meta.get("rollout") or {}).get("description", meta.get("source", "rollout"))
    train = (meta.get("trainer") or {}).get("description", "trainer")
    kl = summary.get("kl_mean")
    return f"rollout {roll}  vs  trainer {train}:  mean KL(μ‖π) = {kl:.3g}" if kl is not None else f"{roll} vs {train}"
