"""Per-token divergence between the rollout distribution μ and the training distribution π, over the vocabulary.

Trust Region Masking (arXiv 2512.23075) needs D_KL(c_t) = KL(μ(·|c_t) ‖ π_θ(·|c_t)) — rollout first —
*exactly* over the vocabulary. Three situations, three answers (:func:`divergence_kind` picks):

* **full rollout logits stored** → :func:`token_kl` / :func:`token_tv`, exact (row-chunked, no extra ``[N, V]``);
* **only the rollout's top-k log-probs stored** (what vLLM/SGLang return cheaply) → :func:`topk_kl_lower_bound`:
  coarse-grain the vocabulary into the k stored tokens plus one "rest" bucket holding the remaining mass,
  q_rest = 1 − Σ_i q_i and p_rest = 1 − Σ_i p_{id_i}, and take the KL of the two (k+1)-point distributions;
* **neither** → no per-token divergence; the ``trm`` preset falls back to the k2/k3 estimators of the sampled
  token's log-ratio.

**What the top-k value guarantees.** Coarse-graining is a channel, so by the data-processing inequality
KL_topk ≤ KL_exact (and TV_topk ≤ TV_exact), with equality at k = V. The gap is exactly
q_rest · KL(μ(·|rest) ‖ π(·|rest)): whatever μ does *inside* the tail is invisible. Consequences for TRM:

* TRM-Max with the bound keeps a sequence iff max_t KL_topk(c_t) ≤ δ. Every sequence the exact test keeps is
  also kept (no false rejections), but a kept sequence may have max_t KL_exact(c_t) > δ — the bound certifies only
  the coarse-grained trust region, so Theorem 4.2's hypothesis D_tok,max ≤ δ (and with it B* and the monotone
  improvement guarantee) is **not** certified. A *rejection* is always sound: KL_topk > δ implies KL_exact > δ.
* The same holds for TRM-Avg (means of lower bounds are lower bounds).
* The unseen part is at most what μ's tail could contribute if it sat where π is least likely — no tail token
  above the k-th probability, so the tail mass q_rest fills π's least likely tokens up to that cap (at most
  q_rest · log(p_rest / min_{j∈rest} π(j))) — small when q_rest is small, which is why a large k makes the test
  nearly exact in practice. :func:`topk_kl_upper_bound` adds it: "keep iff upper ≤ δ" is a sound (certified,
  conservative) TRM-Max test from top-k data alone; :mod:`offpolicy.topk_advice` says when it is vacuous (the
  slack alone above δ) and which k would help.

Every function works on ``[..., V]`` logits (e.g. [B, T, V]) and returns ``[...]`` float32 (float64 in → float64).
The training logits carry gradient (∂KL/∂z = π − μ); the rollout's tensors are data.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch
from torch import Tensor

from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES
from offpolicy.kernels.fused import token_stats_from_logits
from offpolicy.kernels.fused_tiles import rest_mass_bounds, topk_rest_mass
from offpolicy.ratios import as_mask

DivergenceKind = Literal["exact", "topk"]
NONFINITE_DIVERGENCE = 1e6  # cap for +inf/NaN/astronomical KL at valid tokens in divergence_fields (fails any δ)


def _dummy_targets(logits: Tensor) -> Tensor:
    # The statistics kernel always computes log π(y); divergences do not need y, so any in-range id will do.
    return torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)


def _check_logits(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"{name} must be a float [..., V] tensor, got {getattr(x, 'shape', type(x))}")
    return x


def token_kl(rollout_logits: Tensor, logits: Tensor, *, temperature: float = 1.0, rollout_temperature: float = 1.0,
             memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> Tensor:
    """Exact KL(μ ‖ π) per position from two logit tensors ``[..., V]`` → ``[...]`` (TRM's D_KL(c_t), rollout first).

    μ = softmax(rollout_logits / rollout_temperature) (log-probs with −inf entries are fine), π = softmax(logits /
    temperature). Row-chunked: no ``[..., V]`` temporaries beyond the inputs. Differentiable w.r.t. ``logits``.

    >>> # μ = (1/2, 1/2), π = (3/4, 1/4): KL = ½ log(½/¾) + ½ log(½/¼) = ½ log(4/3) = 0.1438
    >>> token_kl(torch.tensor([0.0, 0.0]).log_softmax(-1), torch.tensor([0.75, 0.25]).log())
    tensor(0.1438)
    """
    return _pair_stat("kl", rollout_logits, logits, temperature, rollout_temperature, memory_budget_bytes)


def token_tv(rollout_logits: Tensor, logits: Tensor, *, temperature: float = 1.0, rollout_temperature: float = 1.0,
             memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> Tensor:
    """Exact total variation ½ Σ_a |μ(a) − π(a)| per position, ``[..., V]`` → ``[...]`` (TRM's ε, arXiv 2512.23075 §4).

    >>> # μ = (1/2, 1/2), π = (3/4, 1/4): TV = ½ (¼ + ¼) = 0.25
    >>> token_tv(torch.tensor([0.0, 0.0]), torch.tensor([0.75, 0.25]).log())
    tensor(0.2500)
    """
    return _pair_stat("tv", rollout_logits, logits, temperature, rollout_temperature, memory_budget_bytes)


def _pair_stat(stat: str, rollout_logits: Tensor, logits: Tensor, temperature: float, rollout_temperature: float,
               memory_budget_bytes: int) -> Tensor:
    """One full-vocabulary statistic ("kl" or "tv") between two validated logit tensors of the same shape."""
    _check_logits("rollout_logits", rollout_logits)
    _check_logits("logits", logits)
    if rollout_logits.shape != logits.shape:
        raise ValueError(f"rollout_logits has shape {tuple(rollout_logits.shape)} but logits has {tuple(logits.shape)}")
    stats = token_stats_from_logits(logits, _dummy_targets(logits), temperature=temperature, want=(stat,),
                                    rollout_logits=rollout_logits, rollout_temperature=rollout_temperature,
                                    memory_budget_bytes=memory_budget_bytes)
    return getattr(stats, stat)


@overload
def topk_kl_lower_bound(rollout_topk_logp: Tensor, rollout_topk_ids: Tensor, logits: Tensor, *,
                        temperature: float = ..., with_tv: Literal[False] = ...,
                        memory_budget_bytes: int = ...) -> Tensor: ...


@overload
def topk_kl_lower_bound(rollout_topk_logp: Tensor, rollout_topk_ids: Tensor, logits: Tensor, *,
                        temperature: float = ..., with_tv: Literal[True],
                        memory_budget_bytes: int = ...) -> tuple[Tensor, Tensor]: ...


def topk_kl_lower_bound(rollout_topk_logp: Tensor, rollout_topk_ids: Tensor, logits: Tensor, *,
                        temperature: float = 1.0, with_tv: bool = False,
                        memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> Tensor | tuple[Tensor, Tensor]:
    """Lower bound on KL(μ ‖ π) from the rollout's top-k log-probs only: KL of the (k + 1)-bucket coarse-graining.

    ``rollout_topk_logp`` [..., K] are μ's normalised log-probs of the ids ``rollout_topk_ids`` [..., K] (unique per
    row; −inf entries allowed as padding); ``logits`` [..., V] are π's. Returns ``[...]``
    Σ_i q_i log(q_i / p_i) + q_rest log(q_rest / p_rest) ≤ KL_exact (data-processing inequality; equality at k = V).
    p_rest comes from the logsumexp of the complement, not 1 − Σ p_i, so it stays accurate when top-k covers ~all
    of π. ``with_tv`` also returns the coarse-grained TV (a lower bound on the exact TV). See the module docstring
    for what TRM keeps with it.

    >>> # μ = (½, ¼, ¼), π = (¼, ¼, ½); top-1 of μ is token 0, rest bucket {1, 2}: μ_rest = ½, π_rest = ¾
    >>> # bound = ½ log(½/¼) + ½ log(½/¾) = ½ log 2 + ½ log(2/3) = 0.1438 ≤ exact ½ log 2 + ¼ log ½ = 0.1733
    >>> q = torch.tensor([0.5, 0.25, 0.25]).log(); z = torch.tensor([0.25, 0.25, 0.5]).log()
    >>> topk_kl_lower_bound(q[:1], torch.tensor([0]), z), token_kl(q, z)
    (tensor(0.1438), tensor(0.1733))
    """
    _check_logits("logits", logits)
    if not isinstance(rollout_topk_logp, Tensor) or rollout_topk_logp.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"rollout_topk_logp must be [..., K] with leading shape {tuple(logits.shape[:-1])}, got "
                         f"{getattr(rollout_topk_logp, 'shape', type(rollout_topk_logp))}")
    s = token_stats_from_logits(logits, _dummy_targets(logits), temperature=temperature,
                                want=("kl", "tv") if with_tv else ("kl",), rollout_topk_logp=rollout_topk_logp,
                                rollout_topk_ids=rollout_topk_ids, memory_budget_bytes=memory_budget_bytes)
    assert s.kl is not None  # requested
    if with_tv:
        assert s.tv is not None
        return s.kl, s.tv
    return s.kl


@torch.no_grad()
def topk_kl_upper_bound(rollout_topk_logp: Tensor, rollout_topk_ids: Tensor, logits: Tensor, *,
                        temperature: float = 1.0, memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> Tensor:
    """Certified upper bound on KL(μ ‖ π) from μ's top-k only: the head's exact terms plus the largest tail term
    that any μ consistent with the top-k allows.

    What the top-k says about μ's tail R (the other V − k tokens): its mass is q_R = 1 − Σ_i q_i, and no tail token is
    more likely than the k-th: μ_j ≤ c = min_i q_i (the k entries are μ's *k most likely* tokens, as an engine's
    top-k log-probs are). KL(μ‖π) = Σ_head q_i log(q_i/p_i) + Σ_R μ_j log(μ_j/π_j), and the tail term is convex in
    μ, so its largest value over {0 ≤ μ_j ≤ c, Σ_R μ_j = q_R} is at a vertex: c on each of π's ⌊q_R/c⌋ least likely
    tail tokens, the remainder on the next one. That is the bound — the exact supremum given the top-k, so no
    certified test from top-k data can be tighter. (Without the cap it would be q_R · log(q_R / π_min): all tail mass
    on π's least likely token, up to 10× looser at k ≥ 20 on the embedded models under live vLLM.) The rest mass
    and the cap are taken at the worst ends of what the rounding of the given log-probs allows
    (:func:`~offpolicy.kernels.fused_tiles.rest_mass_bounds`), so "keep iff upper ≤ δ" is a *sound* TRM test: every kept
    sequence satisfies the exact test. It is vacuous when the tail is heavy — q_R times the log-ratio of the k-th
    probability to π's least likely tail tokens (often 10–20 nats) above δ — and then only a larger k helps
    (:mod:`offpolicy.topk_advice` says which). Shapes as :func:`topk_kl_lower_bound`; no gradient.

    >>> # μ = (½, ¼, ¼), π = (¼, ¼, ½), top-1 = token 0 (cap ½ ≥ q_R = ½: all tail mass may sit on token 1, π = ¼):
    >>> # upper = ½ log(½/¼) + ½ log(½/¼) = 0.6931 ≥ exact 0.1733
    >>> q = torch.tensor([0.5, 0.25, 0.25]).log(); z = torch.tensor([0.25, 0.25, 0.5]).log()
    >>> topk_kl_upper_bound(q[:1], torch.tensor([0]), z)
    tensor(0.6931)
    >>> # μ = (0.4, 0.2, 0.2, 0.2), π uniform, top-1: q_R = 0.6 but each tail token ≤ 0.4, so the worst tail is
    >>> # (0.4, 0.2, 0): 0.4 log(0.4/0.25) + 0.4 log(0.4/0.25) + 0.2 log(0.2/0.25) = 0.1880 + 0.1880 − 0.0446 = 0.3314
    >>> # (uncapped: 0.1880 + 0.6 log(0.6/0.25) = 0.7133); exact = lower = 0.0541
    >>> q = torch.tensor([0.4, 0.2, 0.2, 0.2]).log(); z = torch.zeros(4)
    >>> topk_kl_upper_bound(q[:1], torch.tensor([0]), z), token_kl(q, z)
    (tensor(0.3314), tensor(0.0541))
    """
    lower = topk_kl_lower_bound(rollout_topk_logp, rollout_topk_ids, logits, temperature=temperature,
                                memory_budget_bytes=memory_budget_bytes)
    vocab, k = logits.shape[-1], rollout_topk_logp.shape[-1]
    z_all = logits.reshape(-1, vocab)
    ids = rollout_topk_ids.reshape(-1, k)
    lq = rollout_topk_logp.reshape(-1, k)
    gap = []
    rows = max(1, memory_budget_bytes // (8 * 8 * vocab))
    for a in range(0, z_all.shape[0], rows):
        z = z_all[a:a + rows].double() / temperature
        lse = z.logsumexp(dim=-1, keepdim=True)
        log_p_rest = z.scatter(1, ids[a:a + rows], float("-inf")).logsumexp(dim=-1, keepdim=True) - lse
        log_p_tail = z.scatter_(1, ids[a:a + rows], float("inf")) - lse  # log π on the tail, +inf on the head
        # the lower bound's tail is f(q) = q log(q / p_rest) at its chosen q (fused.topk_rest_mass); the exact tail
        # is at most the capped vertex value at the true rest mass, which lies in [lo, hi] (rest_mass_bounds)
        lo, hi = rest_mass_bounds(lq[a:a + rows], vocab)
        chosen = topk_rest_mass((lo, hi), log_p_rest, torch.float64)
        has_rest = torch.isfinite(log_p_rest)  # an empty complement: no tail at all
        tail = capped_tail_max(log_p_tail, topk_cap(lq[a:a + rows]), lo, hi)
        gap.append(torch.where(has_rest, tail - _xlog(chosen, log_p_rest), torch.zeros_like(lo)).squeeze(-1))
    return lower + torch.cat(gap).reshape(lower.shape).to(lower.dtype)


def topk_cap(topk_logp: Tensor) -> Tensor:
    """The largest probability a token outside μ's top-k can have, ``[N, 1]`` float64: the smallest finite given
    probability, raised by its rounding (a log-prob of dtype eps is off by up to |lq|·eps/2); 1 (no cap) for a row
    with no finite entry.

    >>> topk_cap(torch.tensor([[0.0, -1.0, -float("inf")]], dtype=torch.float64))  # e^-1 · (1 + 1·eps64/2)
    tensor([[0.3679]], dtype=torch.float64)
    """
    lq = topk_logp.double()
    finite = torch.isfinite(lq)
    lq_min = torch.where(finite, lq, torch.full_like(lq, math.inf)).amin(dim=-1, keepdim=True)
    slack = 0.5 * torch.finfo(topk_logp.dtype).eps * lq_min.abs() + 8 * torch.finfo(torch.float64).eps
    cap = (lq_min + slack).exp().clamp(max=1.0)
    return torch.where(finite.any(dim=-1, keepdim=True), cap, torch.ones_like(cap))


def _capped_tail(log_p_sorted: Tensor, cap: Tensor, q: Tensor, n_rest: Tensor) -> Tensor:
    """Σ_j w_j log(w_j / π_j) with w_j = clamp(q − j·cap, 0, cap) over π's tail sorted ascending ``[N, V]`` (+inf
    after the ``n_rest`` tail tokens); +inf where q does not fit (q > n_rest · cap)."""
    j = torch.arange(log_p_sorted.shape[-1], dtype=torch.float64, device=log_p_sorted.device)
    w = torch.minimum((q - j * cap).clamp(min=0.0), cap)
    inside = j < n_rest
    term = torch.where((w > 0) & inside, w * (w.clamp(min=1e-300).log() - log_p_sorted.clamp(max=0.0)),
                       torch.zeros_like(w))
    fits = q <= n_rest * cap * (1 + 1e-12)
    return torch.where(fits, term.sum(dim=-1, keepdim=True), torch.full_like(q, math.inf))


def capped_tail_max(log_p_tail: Tensor, cap: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """max Σ_{j∈R} μ_j log(μ_j / π_j) over 0 ≤ μ_j ≤ ``cap`` and lo ≤ Σ_R μ_j ≤ hi, per row ``[N, 1]`` float64.

    ``log_p_tail`` [N, V]: log π on the tail tokens, +inf on the head. The objective is convex, so the maximum is at a
    vertex of that polytope: every μ_j at 0 or ``cap`` but one, the sum at ``lo`` or ``hi`` — or all at 0 / ``cap``
    with the sum m·cap inside [lo, hi]; the vertex puts the largest masses on π's least likely tokens. Capped at the
    uncapped bound max(lo, hi)·log(·/π_min), which it never exceeds when the inputs are consistent.

    >>> # tail π = (¼, ¼, ½) (and a head token at +inf), cap 0.4, rest mass exactly 0.6: (0.4, 0.2, 0) on (¼, ¼, ½)
    >>> lp = torch.tensor([[0.25, 0.25, 0.5, 1.0]], dtype=torch.float64).log(); lp[0, 3] = float("inf")
    >>> m = torch.tensor([[0.6]], dtype=torch.float64)
    >>> capped_tail_max(lp, torch.tensor([[0.4]], dtype=torch.float64), m, m)  # 0.1880 − 0.0446
    tensor([[0.1434]], dtype=torch.float64)
    """
    n_rest = torch.isfinite(log_p_tail).sum(dim=-1, keepdim=True).to(torch.float64)
    # the tail cannot hold more than n_rest · cap: the rounding interval ends there (lo beyond it: inconsistent
    # inputs, and _capped_tail's +inf leaves the uncapped bound)
    fitted_hi = torch.maximum(torch.minimum(hi, n_rest * cap), lo)
    log_p_sorted = _least_likely(log_p_tail, fitted_hi / cap)
    log_p_min = log_p_sorted[:, :1]
    uncapped = torch.maximum(_xlog(lo, log_p_min), _xlog(hi, log_p_min))
    hi = fitted_hi
    best = torch.maximum(_capped_tail(log_p_sorted, cap, lo, n_rest), _capped_tail(log_p_sorted, cap, hi, n_rest))
    m_cap = torch.floor(hi / cap) * cap  # a vertex with every mass at the cap, if its sum falls inside [lo, hi]
    inner = torch.where(m_cap >= lo, _capped_tail(log_p_sorted, cap, m_cap, n_rest), torch.full_like(lo, -math.inf))
    return torch.minimum(torch.maximum(best, inner), uncapped)


def _least_likely(log_p_tail: Tensor, filled: Tensor) -> Tensor:
    """π's least likely tail tokens, ascending ``[N, m]``: as many as any row's vertex can fill (``filled`` = its
    largest rest mass over the cap, ``[N, 1]``), plus two; the whole row sorted when that is most of it. A vertex puts
    mass only on the first ⌈q / cap⌉ tokens, so the others add exact zeros to :func:`_capped_tail`'s sum; selecting
    them instead of sorting the row is most of the certified bound's time at a real vocabulary."""
    vocab = log_p_tail.shape[-1]
    need = torch.nan_to_num(filled.amax(), nan=vocab, posinf=vocab) if filled.numel() else filled.new_zeros(())
    m = int(min(vocab, max(1.0, math.ceil(float(need)) + 2)))  # one host sync per chunk: the selection's size
    if 4 * m >= vocab:
        return log_p_tail.sort(dim=-1).values
    return log_p_tail.topk(m, dim=-1, largest=False, sorted=True).values


def _xlog(q: Tensor, log_b: Tensor) -> Tensor:
    """q·(log q − log b), 0 at q = 0 (float64)."""
    return torch.where(q > 0, q * (q.clamp(min=1e-300).log() - log_b), torch.zeros_like(q))


def divergence_kind(*, rollout_logits: Tensor | None = None, rollout_topk_logp: Tensor | None = None,
                    rollout_topk_ids: Tensor | None = None) -> DivergenceKind | None:
    """Which TRM divergence the stored rollout data allows: ``"exact"``, ``"topk"`` or None (→ k2/k3 estimators).

    Full logits win over top-k (exact beats a lower bound); with neither the caller leaves
    ``LogProbBatch.token_divergence`` as None and the ``trm`` preset uses the sampled-token estimators.

    >>> divergence_kind(rollout_topk_logp=torch.zeros(1, 2), rollout_topk_ids=torch.zeros(1, 2, dtype=torch.long))
    'topk'
    >>> divergence_kind() is None
    True
    """
    if rollout_logits is not None:
        return "exact"
    if (rollout_topk_logp is None) != (rollout_topk_ids is None):
        raise ValueError("rollout_topk_logp and rollout_topk_ids must be given together")
    return "topk" if rollout_topk_logp is not None else None


def divergence_fields(logits: Tensor, mask: Tensor | None = None, *, rollout_logits: Tensor | None = None,
                      rollout_topk_logp: Tensor | None = None, rollout_topk_ids: Tensor | None = None,
                      temperature: float = 1.0, rollout_temperature: float = 1.0,
                      memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> dict[str, object]:
    """``{"token_divergence": [B, T] | None, "token_divergence_kind": "exact" | "topk"}`` for ``LogProbBatch``.

    Picks the source with :func:`divergence_kind` and computes KL(μ ‖ π) per token from ``logits`` [B, T, V]
    (π_θ, or π_old for a per-rollout test). The result is detached float32 with 0 at masked positions (a mask
    test, not a loss term) and ``NONFINITE_DIVERGENCE`` where the KL is +inf/NaN at a valid position.
    Use as ``LogProbBatch(..., **divergence_fields(...))`` or ``batch.replace(**fields)``.
    Second row: μ = softmax(1, 0, 0) = (0.5761, 0.2119, 0.2119), π uniform:
    KL = 0.5761 log(3·0.5761) + 2 · 0.2119 log(3·0.2119) = 0.3153 − 0.1920 = 0.1233.

    >>> z = torch.zeros(1, 2, 3); roll = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]])
    >>> f = divergence_fields(z, torch.tensor([[1, 1]]), rollout_logits=roll)
    >>> f["token_divergence_kind"], f["token_divergence"]
    ('exact', tensor([[0.0000, 0.1233]]))
    """
    _check_logits("logits", logits)
    kind = divergence_kind(rollout_logits=rollout_logits, rollout_topk_logp=rollout_topk_logp,
                           rollout_topk_ids=rollout_topk_ids)
    if kind is None:
        return {"token_divergence": None, "token_divergence_kind": "exact"}
    with torch.no_grad():
        if kind == "exact":
            assert rollout_logits is not None  # what divergence_kind read
            d = token_kl(rollout_logits, logits, temperature=temperature, rollout_temperature=rollout_temperature,
                         memory_budget_bytes=memory_budget_bytes)
        else:
            assert rollout_topk_logp is not None and rollout_topk_ids is not None
            d = topk_kl_lower_bound(rollout_topk_logp, rollout_topk_ids, logits, temperature=temperature,
                                    memory_budget_bytes=memory_budget_bytes)
    # A non-finite divergence at a valid token (π gives 0 mass where μ gives some) must still fail any threshold:
    # make it large and finite rather than letting a NaN-ignoring reduction read it as 0.
    d = torch.nan_to_num(d.float(), nan=NONFINITE_DIVERGENCE, posinf=NONFINITE_DIVERGENCE).clamp(max=NONFINITE_DIVERGENCE)
    if mask is not None:
        if mask.shape != d.shape:
            raise ValueError(f"mask has shape {tuple(mask.shape)} but logits give {tuple(d.shape)}")
        d = torch.where(as_mask(mask), d, torch.zeros_like(d))
    return {"token_divergence": d, "token_divergence_kind": kind}
