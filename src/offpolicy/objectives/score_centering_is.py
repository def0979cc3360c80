"""Score centering whose coefficients follow the importance-sampling rule (arXiv 2609.20807, composed with TIS, IcePop
or sampling replay as NeMo-RL 0.8.0 and verl ship it).

:mod:`~offpolicy.objectives.score_centering` centres the score on q whatever weights the sampled token: the drift
term it removes is E_q[∇log p]. Under a token-level IS rule the sampled token's update is A·w(p_y/q_y)·∇log p(y),
so the term whose expectation compounds is the *weighted* score, with expectation over y ~ q

    E_q[w(p/q) ∇log p] = Σ_a m_a ∇log p_a,        m_a = q_a · w(p_a / q_a)   ("head mass")

and centring it gives each token the update A·(w_y ∇log p(y) − Σ_a m_a ∇log p_a). The rules (r = p/q, the trainer's
current p over the sampler's q, both detached in the coefficients):

* ``tis``     w(r) = clamp(r, lo, hi)              m_a = clamp(p_a, lo·q_a, hi·q_a)
* ``icepop``  w(r) = r · 1[lo ≤ r ≤ hi]            m_a = p_a · 1[lo·q_a ≤ p_a ≤ hi·q_a]
* ``none``    w(r) = 1                             m_a = q_a  (the plain centring of score_centering.py)

An unclipped weight makes the weighted score's expectation Σ_a p_a ∇log p_a = 0: only the tokens a rule clips or
masks leave a drift, which is what these coefficients remove (and why q = p gives no centring at all).

From the sampler's top-k head H alone (a serving engine's processed log-probs), q's tail is modelled as p's tail
rescaled, q̂_a = ρ·p_a off H with ρ = (1 − Σ_H q) / max(1 − Σ_H p, 1e-6); every tail token then has the same ratio
1/ρ, so the tail's coefficients are α·p_a with α = ρ·w(1/ρ) (``tis``: α = clamp(1, lo·ρ, hi·ρ)), and because
Σ_a p_a ∇log p_a = 0 the tail folds into the head:

    Σ_a m_a ∇log p_a ≈ Σ_{v∈H} (m_v − α p_v) ∇log p_v,        c_v = m_v − α·p_v

(NeMo-RL 0.8.0, ``nemo_rl.algorithms.loss.score_centering.compute_score_centering_term`` — its source is not stored
where this library's references are read, so the rule is implemented from its release notes' formula; verl's
``verl/trainer/ppo/score_centering.py::score_centering_correction`` writes the same α as ``rho * weight_fn(1 / rho)``
for TIS and IcePop, and tests/objectives/test_score_centering_is.py checks both forms.) When H is the sampler's
whole support — it sampled with top-k / top-p and reported every token that survived, as SkyRL records it — q's
tail is 0, so ρ = 0, α = 0 and the centring is exact over that support.

``replay`` (sampling-support replay, :func:`~offpolicy.corrections.vocabulary.replay_support_logp`): the trainer's
distribution is renormalised on the sampler's recorded support S, p^S_v = p_v / Σ_S p, so q and p^S share S and
there is no tail: c_v = q_v · w(p^S_v / q_v) on S, ∇ taken through log p^S.

In the loss: :func:`weighted_centered_logp` gives log p(y) the gradient sg(w_y)·∇log p(y) − ∇c, value unchanged, so
an objective without a correction (the weight lives in the log-prob's gradient, not in a coefficient that would also
scale — or, for a masked token, drop — the centring term) trains on A·(w_y ∇log p(y) − Σ_v c_v ∇log p_v).
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.objectives.base import check_nonnegative, check_positive
from offpolicy.objectives.score_centering import _check_head, _check_pair, _head

WEIGHTINGS = ("tis", "icepop", "none")
TAIL_FLOOR = 1e-6  # NeMo-RL's floor on p's tail mass in ρ (verl's eps is the same 1e-6)


def check_weighting(weighting: object, lower: object, upper: object) -> tuple[str, float, float]:
    """``(weighting, lo, hi)`` validated: ``weighting`` one of :data:`WEIGHTINGS`, 0 ≤ lo ≤ hi finite (``none``
    ignores them).

    >>> check_weighting("tis", 0.0, 2.0)
    ('tis', 0.0, 2.0)
    >>> check_weighting("icepop", 5.0, 0.5)
    Traceback (most recent call last):
    ...
    ValueError: lower must be <= upper, got lower=5.0, upper=0.5
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    lo, hi = check_nonnegative("lower", lower), check_nonnegative("upper", upper)
    if lo > hi:
        raise ValueError(f"lower must be <= upper, got lower={lower!r}, upper={upper!r}")
    return weighting, lo, hi


def is_weight(ratio: Tensor, weighting: str, lower: float, upper: float) -> Tensor:
    """w(r) of the rule, elementwise (``ratio`` ≥ 0, +inf allowed: a token q never samples has w(∞) = ``hi`` for
    ``tis``, 0 for ``icepop``).

    >>> r = torch.tensor([0.2, 1.0, 4.0])
    >>> is_weight(r, "tis", 0.5, 2.0), is_weight(r, "icepop", 0.5, 2.0)
    (tensor([0.5000, 1.0000, 2.0000]), tensor([0., 1., 0.]))
    """
    weighting, lower, upper = check_weighting(weighting, lower, upper)
    if weighting == "tis":
        return ratio.clamp(lower, upper)
    if weighting == "icepop":
        return torch.where((ratio >= lower) & (ratio <= upper), ratio, torch.zeros_like(ratio))
    return torch.ones_like(ratio)


def _head_mass(p: Tensor, q: Tensor, weighting: str, lower: float, upper: float) -> Tensor:
    """m = q · w(p/q) written without the division (q = 0 gives m = 0 for every rule)."""
    if weighting == "tis":
        return torch.minimum(torch.maximum(p, lower * q), upper * q)
    if weighting == "icepop":
        return torch.where((p >= lower * q) & (p <= upper * q) & (q > 0), p, torch.zeros_like(p))
    return q


def _tail_coefficient(rho: Tensor, weighting: str, lower: float, upper: float) -> Tensor:
    """α = ρ·w(1/ρ): the tail's coefficient per unit of p (ρ = 0 — no sampler tail — gives α = 0)."""
    if weighting == "tis":
        return torch.minimum(torch.maximum(torch.ones_like(rho), lower * rho), upper * rho)
    if weighting == "icepop":
        return ((lower * rho <= 1.0) & (upper * rho >= 1.0) & (rho > 0)).to(rho.dtype)
    return rho


def score_center_weighted(logits: Tensor, sampler_logits: Tensor, *, weighting: str = "tis", lower: float = 0.0,
                          upper: float = 2.0, temperature: float = 1.0) -> Tensor:
    """Exact c = Σ_a sg(m_a) log p_a per position over the whole vocabulary, ``[..., V]`` → ``[...]`` float32,
    m_a = q_a·w(p_a/q_a) (module docstring); gradient w.r.t. ``logits``: (m − p·Σm)/T = E_q[w ∇_z log p].
    p = softmax(logits/T) (differentiable), q = softmax(sampler_logits/T) (−inf entries allowed). Allocates ``[N, V]``.

    >>> z, zq = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().requires_grad_(True), torch.tensor([0.5, 0.1, 0.3, 0.1]).log()
    >>> torch.autograd.grad(score_center_weighted(z, zq, lower=0.5, upper=2.0), z)[0]  # m = (.25, .2, .3, .2) − .95·p
    tensor([ 0.1550,  0.0100,  0.0150, -0.1800])
    """
    logits, sampler_logits = _check_pair(logits, sampler_logits)
    t = check_positive("temperature", temperature)
    weighting, lower, upper = check_weighting(weighting, lower, upper)
    lp = torch.log_softmax(logits.float() / t, -1)
    q = torch.softmax(sampler_logits.detach().float() / t, -1)
    m = _head_mass(lp.detach().exp(), q, weighting, lower, upper)
    m = torch.where(torch.isfinite(m) & (m > 0), m, 0.0)  # a NaN sampler row (padding) centres nothing
    return torch.where(m > 0, m * lp, torch.zeros_like(lp)).sum(-1)


def score_center_weighted_topk(logits: Tensor, topk_ids: Tensor, topk_logq: Tensor, *, weighting: str = "tis",
                               lower: float = 0.0, upper: float = 2.0, temperature: float = 1.0,
                               replay: bool = False) -> Tensor:
    """c = Σ_{v∈H} sg(c_v) log p_v per position from the sampler's head H only, c_v = m_v − α·p_v (module
    docstring: NeMo-RL's coefficients, exact when H is q's whole support). Arguments as
    :func:`~offpolicy.objectives.score_centering.score_center_topk`: ``logits`` ``[..., V]`` the trainer's raw logits
    (differentiable, divided by ``temperature`` here), ``topk_ids`` ``[..., K]`` distinct ids, ``topk_logq``
    ``[..., K]`` the tempered sampler's normalised log-probs (−inf = an empty slot, not in H).

    ``replay``: H is the support the sampler drew from (``topk_logq`` sums to 1 over it) and the trainer's
    log-probs are renormalised on it (p^S, as :func:`~offpolicy.corrections.vocabulary.replay_support_logp` gives the
    sampled token's): c = Σ_{v∈S} sg(q_v·w(p^S_v/q_v)) log p^S_v, no tail.

    >>> z = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().requires_grad_(True)
    >>> q = torch.tensor([0.5, 0.1, 0.3, 0.1])        # H = {0, 2}: m = (.25, .3), ρ = .2/.6, α = clamp(1, ρ/2, 2ρ) = ⅔
    >>> c = score_center_weighted_topk(z, torch.tensor([0, 2]), q[[0, 2]].log(), lower=0.5, upper=2.0)
    >>> torch.autograd.grad(c, z)[0]                   # c_H = (.25 − ⅔·.1, .3 − ⅔·.3) = (.18333, .1); (c − p·Σc)
    tensor([ 0.1550, -0.0567,  0.0150, -0.1133])
    """
    logits, topk_ids, topk_logq = _check_head(logits, topk_ids, topk_logq)
    t = check_positive("temperature", temperature)
    weighting, lower, upper = check_weighting(weighting, lower, upper)
    lp = torch.log_softmax(logits.float() / t, -1)
    lp_head, q_head, reported, tail_p, tail_q = _head(lp, topk_ids, topk_logq)
    if replay:  # renormalise p on the support S = the reported slots (their log-sum-exp, with the graph)
        lp_head = lp_head - torch.where(reported, lp_head, float("-inf")).logsumexp(-1, keepdim=True)
        coef = _head_mass(lp_head.detach().exp(), q_head, weighting, lower, upper)
    else:
        rho = tail_q / tail_p.clamp(min=TAIL_FLOOR)
        alpha = _tail_coefficient(rho, weighting, lower, upper)
        p_head = lp_head.detach().exp()
        coef = _head_mass(p_head, q_head, weighting, lower, upper) - alpha * p_head
    coef = torch.where(reported & torch.isfinite(coef), coef, 0.0)
    return torch.where(coef != 0, coef * lp_head, 0.0).sum(-1)


def sampled_is_weight(logp: Tensor, rollout_logp: Tensor, *, weighting: str = "tis", lower: float = 0.0,
                      upper: float = 2.0) -> Tensor:
    """w(p_y/q_y) of the sampled token, detached, ``[B, T]``: the same rule as the centre's coefficients, on the
    trainer's log-prob ``logp`` and the sampler's ``rollout_logp`` (a non-finite log-ratio gives weight 0).

    >>> sampled_is_weight(torch.tensor([[-0.1, -3.0]]), torch.tensor([[-2.0, -0.1]]), lower=0.5, upper=2.0)
    tensor([[2.0000, 0.5000]])
    """
    weighting, lower, upper = check_weighting(weighting, lower, upper)
    log_r = (logp.detach().float() - rollout_logp.detach().float())
    ok = torch.isfinite(log_r)
    w = is_weight(torch.where(ok, log_r, 0.0).clamp(max=80.0).exp(), weighting, lower, upper)
    return torch.where(ok, w, torch.zeros_like(w))


def weighted_centered_logp(logp: Tensor, weight: Tensor, center: Tensor) -> Tensor:
    """log p(y) whose gradient is sg(w)·∇log p(y) − ∇c, value exactly ``logp`` ``[B, T]``: the sampled token's IS
    weight and the weighted centre in one log-prob, for an objective that applies no correction of its own (a
    correction's coefficient would scale the centring term too, and drop it at a masked token, where the drift it
    removes is still there).

    >>> z = torch.tensor([0.0, 0.0], requires_grad=True)
    >>> lp = torch.log_softmax(z, -1)
    >>> out = weighted_centered_logp(lp[:1], torch.tensor([0.5]), (torch.tensor([0.3, 0.1]) * lp).sum(-1, keepdim=True))
    >>> out.item() == lp[0].item(), torch.autograd.grad(out.sum(), z)[0]  # 0.5·(1 − p) − (m − p·Σm)
    (True, tensor([ 0.1500, -0.1500]))
    """
    for name, x in (("weight", weight), ("center", center)):
        if not isinstance(x, Tensor) or x.shape != logp.shape:
            raise ValueError(f"{name} must have logp's shape {tuple(logp.shape)}, got {getattr(x, 'shape', None)}")
    w = weight.detach().to(logp.dtype)
    return logp + (w - 1.0) * (logp - logp.detach()) + (center.detach() - center).to(logp.dtype)


# the presets' rules: name → (weighting, lo, hi, replay); the bounds are the library's own tis / icepop defaults
PRESET_RULES: dict[str, tuple[str, float, float, bool]] = {
    "tis": ("tis", 0.0, 2.0, False),
    "icepop": ("icepop", 0.5, 5.0, False),
    "replay": ("none", 0.0, 0.0, True),
}


def weighted_centering(logp: Tensor, logits: Tensor, rollout_logp: Tensor, sampler: Tensor | tuple[Tensor, Tensor],
                       *, rule: str, temperature: float = 1.0,
                       targets: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """One minibatch of a trainer: π_θ's log-probs ``logp`` ``[B, T]`` (with their graph) carrying the IS weight and
    the weighted centre of ``rule`` (a key of :data:`PRESET_RULES`), and per-token extras ``[B, T]``
    ``score_centering/is_weight`` (w_y) and ``score_centering/is_clipped`` (1 where the rule moved the sampled
    token's ratio: clamped or masked).

    ``logits`` ``[B, T, V]`` the trainer's raw logits (the same forward as ``logp``), ``rollout_logp`` μ ``[B, T]``,
    ``sampler``: the sampler's raw logits ``[B, T, V]`` (exact over the vocabulary) or its reported head
    ``(ids, logq)`` ``[B, T, K]`` (NeMo-RL's head + tail rule; ``replay`` needs the head: the support it sampled
    from, and ``logp`` renormalised on it, e.g. by :func:`~offpolicy.corrections.vocabulary.replay_support_logp`;
    with ``targets`` ``[B, T]``, the sampled ids, the gradient of log p^S(y) is taken here from ``logits`` on the
    head, while the value stays ``logp``'s — the one π_old was computed like, so the PPO ratio is unchanged).
    No correction should weight the loss as well (the weight is already in the gradient).
    """
    if rule not in PRESET_RULES:
        raise ValueError(f"rule must be one of {tuple(PRESET_RULES)}, got {rule!r}")
    weighting, lower, upper, replay = PRESET_RULES[rule]
    if replay and targets is not None and isinstance(sampler, tuple):  # log p^S(y) on the sampler's support
        ids, logq = sampler
        reported = logq.detach() > float("-inf")
        z = logits.float() / check_positive("temperature", temperature)
        head = torch.where(reported, z.gather(-1, torch.where(reported, ids, ids[..., :1]).long()), float("-inf"))
        replayed = z.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - head.logsumexp(-1)
        logp = logp.detach() + (replayed - replayed.detach()).to(logp.dtype)  # its gradient; the value stays logp's
    if isinstance(sampler, tuple):
        center = score_center_weighted_topk(logits, sampler[0], sampler[1], weighting=weighting, lower=lower,
                                            upper=upper, temperature=temperature, replay=replay)
    elif replay:
        raise ValueError("sampler: rule='replay' needs the sampler's support as a head (ids, logq), got full logits")
    else:
        center = score_center_weighted(logits, sampler, weighting=weighting, lower=lower, upper=upper,
                                       temperature=temperature)
    w = sampled_is_weight(logp, rollout_logp, weighting=weighting, lower=lower, upper=upper)
    ratio = (logp.detach().float() - rollout_logp.detach().float()).clamp(max=80.0).exp()
    clipped = (w != ratio) if weighting != "none" else torch.zeros_like(w, dtype=torch.bool)
    return weighted_centered_logp(logp, w, center.to(logp.dtype)), {"score_centering/is_weight": w,
                                                                    "score_centering/is_clipped": clipped.float()}
