"""Score centering (arXiv 2609.20807): remove the drift term of the policy gradient under a sampler/trainer mismatch.

At a prefix sampled by q (the rollout engine) the policy-gradient update of the trainer p splits as

    E_q[R ∇log p(y)] = E_q[R] · E_q[∇log p] + Cov_q(R, ∇log p)

The first term distills p toward q (weighted by the prefix's expected reward) and compounds, because q is synced back
from p; group-centred advantages do not remove it. Score centering replaces the score ∇log p(y) by the centred score
∇log p(y) − E_q[∇log p], which makes that term exactly zero. In logit space z (p = softmax(z / T)):

    ∇_z log p(y) = (onehot(y) − p) / T,     E_q[∇_z log p] = (q − p) / T,     centred: (onehot(y) − q) / T

so the drift term's size at each position is q − p: its total variation ½‖q − p‖₁ is logged per step.

As a surrogate: log p(y) − Σ_a sg(q_a) log p_a has the centred score as its gradient. :func:`centered_logp` adds that
correction to log p(y) with value 0 (``logp − c + sg(c)``), so every objective and correction sees the same log-probs
and a REINFORCE objective −A·logp becomes −A·(log p(y) − Σ_a sg(q_a) log p_a) in its gradient; it composes with any
mask (a masked token has no gradient at all). No ratio, mask or clip of its own.

Two ways to get c = Σ_a q_a log p_a, differentiable with respect to the trainer's logits:

* :func:`score_center` — exact, from the sampler's full logits; row-chunked forward and backward (a custom autograd
  function whose gradient is g·(q − p)/T), so no ``[N, V]`` temporary beyond a memory budget;
* :func:`score_center_topk` — the peers' top-k rule (SkyRL PR #2244, Miles PR #3317, both open): q is known on its
  top-k head H; the tail mass 1 − m_q (m_q = Σ_H q) is spread over the other tokens in proportion to p,
  q̂_a = κ·p_a with κ = (1 − m_q)/(1 − m_p), m_p = Σ_H p. Because Σ_a p_a ∇log p_a = 0, the tail's contribution folds
  into the head: E_q̂[∇log p] = Σ_{a∈H} (q_a − κ p_a) ∇log p_a, so only log p on H is needed. Its logit gradient is
  q̂ − p exactly; the error against the exact centring is q − q̂, zero on H, whose size :func:`topk_tail_gap` measures.
  A serving engine (vLLM, SGLang, llama.cpp) reports that head itself — its processed top-K log-probs at each sampled
  position (``SamplingConfig.logprobs_topk``) — so the trainer centres on the sampling decode's own numbers, and
  :func:`topk_drift_tv` estimates the drift ½‖q̂ − p‖₁ without the full q.

The peers' PRs are open and their code is not stored here; the proportional-tail formula above is the rule their
descriptions name ("proportional-tail centered loss", "sampler-expected, calibration-weighted score"), derived here.

Both distributions are the full tempered ones (temperature only, like :func:`~offpolicy.train.scoring.exact_token_kl`):
top-k / top-p truncation of two different logit sets cuts them at different tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from offpolicy.divergence import _check_logits
from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES, chunk_rows, row_chunks
from offpolicy.objectives.base import check_positive


def _check_pair(logits: object, sampler_logits: object) -> tuple[Tensor, Tensor]:
    z = _check_logits("logits", logits)
    q = _check_logits("sampler_logits", sampler_logits)
    if z.shape != q.shape:
        raise ValueError(f"sampler_logits has shape {tuple(q.shape)} but logits has "
                         f"{tuple(z.shape)}; they must match")
    return z, q


class _ScoreCenter(torch.autograd.Function):
    """c = Σ_a q_a log softmax(z/T)_a per row; ∂c/∂z = (q − p·Σq)/T. Row-chunked both ways."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, sampler_logits: Tensor, temperature: float, rows: int) -> Tensor:
        n = logits.shape[0]
        out = logits.new_empty(n, dtype=torch.float32)
        for a, b in row_chunks(n, rows):
            lp = torch.log_softmax(logits[a:b].float() / temperature, -1)
            q = torch.softmax(sampler_logits[a:b].float() / temperature, -1)
            out[a:b] = torch.where(q > 0, q * lp, torch.zeros_like(lp)).sum(-1)
        ctx.save_for_backward(logits, sampler_logits)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None, None]:
        logits, sampler_logits = ctx.saved_tensors
        grad = torch.empty_like(logits, dtype=torch.float32)
        for a, b in row_chunks(logits.shape[0], ctx.rows):
            p = torch.softmax(logits[a:b].float() / ctx.temperature, -1)
            q = torch.softmax(sampler_logits[a:b].float() / ctx.temperature, -1)
            grad[a:b] = grad_out[a:b, None] * (q - p) / ctx.temperature  # Σ_a q_a = 1
        return grad.to(logits.dtype), None, None, None


def score_center(logits: Tensor, sampler_logits: Tensor, *, temperature: float = 1.0,
                 memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> Tensor:
    """Exact c = Σ_a sg(q_a) log p_a per position, ``[..., V]`` → ``[...]`` float32, differentiable w.r.t. ``logits``
    (gradient (q − p)/T per position: E_q[∇_z log p]). p = softmax(logits/T), q = softmax(sampler_logits/T), the
    sampler's full distribution (−inf entries allowed). Row-chunked under ``memory_budget_bytes``.

    >>> z = torch.tensor([0.0, 0.0], requires_grad=True)        # p = (½, ½)
    >>> c = score_center(z, torch.tensor([0.75, 0.25]).log())   # q = (¾, ¼): c = ¾ log ½ + ¼ log ½ = log ½
    >>> round(c.item(), 4), torch.autograd.grad(c, z)[0]        # ∂c/∂z = q − p
    (-0.6931, tensor([ 0.2500, -0.2500]))
    """
    logits, sampler_logits = _check_pair(logits, sampler_logits)
    t = check_positive("temperature", temperature)
    shape, vocab = logits.shape[:-1], logits.shape[-1]
    flat, flat_q = logits.reshape(-1, vocab), sampler_logits.detach().reshape(-1, vocab)
    rows = chunk_rows(flat.shape[0], vocab, buffers=3, memory_budget_bytes=memory_budget_bytes)
    return _ScoreCenter.apply(flat, flat_q, t, rows).reshape(shape)


def _check_head(logits: object, topk_ids: object, topk_logq: object) -> tuple[Tensor, Tensor, Tensor]:
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [..., V] tensor, got {type(logits).__name__}")
    if not isinstance(topk_ids, Tensor) or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("topk_ids must be an integer [..., K] tensor")
    if not isinstance(topk_logq, Tensor) or topk_logq.shape != topk_ids.shape:
        raise ValueError(f"topk_logq must have topk_ids' shape {tuple(topk_ids.shape)}, got "
                         f"{getattr(topk_logq, 'shape', type(topk_logq))}")
    if topk_ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"topk_ids has shape {tuple(topk_ids.shape)} but logits has {tuple(logits.shape)}: the "
                         "leading dimensions must match")
    return logits, topk_ids, topk_logq


def _head(lp: Tensor, topk_ids: Tensor, topk_logq: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(lp_head, q_head, reported, tail_p, tail_q)`` of the head H: log p and q on the K slots, which slots hold a
    token (a −inf slot is one the engine did not report: fewer than K tokens survived its truncation), and the two
    tails 1 − m_p, 1 − m_q ``[..., 1]`` (detached)."""
    reported = topk_logq.detach() > float("-inf")
    # an unreported slot points at the slot-0 token (always reported if any is), so it marks nothing new as in H
    ids = torch.where(reported, topk_ids, topk_ids[..., :1]).long()
    lp_head = lp.gather(-1, ids)
    q_head = torch.where(reported, topk_logq.detach().float().exp(), 0.0)
    tail_q = (1.0 - q_head.sum(-1, keepdim=True)).clamp(min=0.0)
    # p's tail mass from its own logits (not 1 − Σ_H p, which is rounding noise when H holds nearly everything)
    in_head = torch.zeros_like(lp, dtype=torch.bool).scatter_(-1, ids, True)
    tail_p = torch.logsumexp(lp.detach().masked_fill(in_head, float("-inf")), -1, keepdim=True).exp()
    return lp_head, q_head, reported, tail_p, tail_q


def score_center_topk(logits: Tensor, topk_ids: Tensor, topk_logq: Tensor, *, temperature: float = 1.0) -> Tensor:
    """The proportional-tail estimate c = Σ_{a∈H} sg(q_a − κ p_a) log p_a per position (module docstring), from the
    sampler's top-k head only: ``topk_ids`` ``[..., K]`` (distinct ids per position) and ``topk_logq`` ``[..., K]`` its
    normalised log-probs of the *tempered* sampler, log softmax(z_q/T) — what a serving engine reports as processed
    log-probs (temperature applied), passed as they are; ``logits`` ``[..., V]`` the trainer's raw logits,
    differentiable, divided by ``temperature`` here. Gradient w.r.t. the logits: (q̂ − p)/T. A −inf entry of
    ``topk_logq`` is a slot the engine left empty (its truncation kept fewer than K tokens): not part of H.

    >>> z = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)   # p = ⅓ each
    >>> q = torch.tensor([0.6, 0.3, 0.1])                      # head H = {0}: m_q = 0.6, m_p = ⅓, κ = 0.4/(2/3) = 0.6
    >>> c = score_center_topk(z, torch.tensor([0]), q[:1].log())
    >>> torch.autograd.grad(c, z)[0]   # q̂ − p = (0.6, 0.6·⅓, 0.6·⅓) − ⅓ = (0.2667, −0.1333, −0.1333)
    tensor([ 0.2667, -0.1333, -0.1333])
    """
    return _center_of(*_head_of(logits, topk_ids, topk_logq, temperature))


def _head_of(logits: Tensor, topk_ids: Tensor, topk_logq: Tensor,
             temperature: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`_head` of log softmax(logits / T), the arguments checked."""
    logits, topk_ids, topk_logq = _check_head(logits, topk_ids, topk_logq)
    t = check_positive("temperature", temperature)
    return _head(torch.log_softmax(logits.float() / t, -1), topk_ids, topk_logq)


def _center_of(lp_head: Tensor, q_head: Tensor, reported: Tensor, tail_p: Tensor, tail_q: Tensor) -> Tensor:
    """c = Σ_{a∈H} sg(q_a − κ p_a) log p_a, κ = (1 − m_q)/(1 − m_p), from :func:`_head`'s parts."""
    kappa = torch.where(tail_p > 0, tail_q / tail_p.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    weight = torch.where(reported, q_head - kappa * lp_head.detach().exp(), 0.0)
    return (weight * lp_head).sum(-1)


def _drift_of(lp_head: Tensor, q_head: Tensor, reported: Tensor, tail_p: Tensor, tail_q: Tensor) -> Tensor:
    """½(Σ_{a∈H} |q_a − p_a| + |m_p − m_q|) from :func:`_head`'s parts (no gradient)."""
    head = torch.where(reported, (q_head - lp_head.detach().exp()).abs(), 0.0).sum(-1)
    return 0.5 * (head + (tail_p - tail_q).abs()[..., 0])


def score_center_topk_with_drift(logits: Tensor, topk_ids: Tensor, topk_logq: Tensor, *,
                                 temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """``(centre, drift)`` ``[...]``: :func:`score_center_topk` and :func:`topk_drift_tv` from one log-softmax of the
    logits (the drift without a gradient), for a pass that logs the drift beside the centre it trains on."""
    parts = _head_of(logits, topk_ids, topk_logq, temperature)
    return _center_of(*parts), _drift_of(*parts).detach()


@torch.no_grad()
def topk_drift_tv(logits: Tensor, topk_ids: Tensor, topk_logq: Tensor, *, temperature: float = 1.0) -> Tensor:
    """The drift ½‖q̂ − p‖₁ per position ``[...]`` from the sampler's head only (same arguments as
    :func:`score_center_topk`): the proportional-tail estimate of ½‖q − p‖₁ when q is known on H alone.

    Off H, q̂_a = κ p_a with κ = (1 − m_q)/(1 − m_p), so Σ_{a∉H} |q̂_a − p_a| = |κ − 1|·(1 − m_p) = |m_p − m_q|:

        ½‖q̂ − p‖₁ = ½(Σ_{a∈H} |q_a − p_a| + |m_p − m_q|)        (m = head mass)

    It never exceeds the exact drift (Σ_{a∉H} |q_a − p_a| ≥ |Σ_{a∉H} (q_a − p_a)| = |m_p − m_q|, the triangle
    inequality) and equals it when H covers q's support (then q = 0 off H, m_q = 1 and both tails are 1 − m_p).

    >>> p_logits = torch.zeros(4)                                  # p = ¼ each
    >>> q = torch.tensor([0.5, 0.3, 0.2, 0.0])                     # H = {0, 1}: m_q = 0.8, m_p = 0.5
    >>> round(topk_drift_tv(p_logits, torch.tensor([0, 1]), q[:2].log()).item(), 4)  # ½(0.25 + 0.05 + 0.3)
    0.3
    """
    return _drift_of(*_head_of(logits, topk_ids, topk_logq, temperature))


def centering_token_metrics(drift: Tensor, topk_logq: Tensor | None = None, *,
                            head_mass_q: Tensor | None = None) -> dict[str, Tensor]:
    """Score centering's per-token numbers under the names every host logs (each averages them over its response
    tokens): ``score_centering/drift_tv`` (``drift`` ``[...]``, ½‖q − p‖₁ or its top-K estimate
    :func:`topk_drift_tv`) and ``score_centering/head_mass_q`` (m_q = Σ_H q ``[...]``: how much of q the top-K holds;
    the rest is spread ∝ p), from the head's log-probs ``topk_logq`` ``[..., K]`` or given as ``head_mass_q``
    (:func:`topk_tail_gap`'s); exactly one of the two."""
    if (topk_logq is None) == (head_mass_q is None):
        raise ValueError("centering_token_metrics: pass topk_logq or head_mass_q, not both or neither")
    mass = topk_logq.detach().float().exp().sum(-1) if topk_logq is not None else head_mass_q
    assert mass is not None  # one of the two, checked above
    return {"score_centering/drift_tv": drift.detach().float(), "score_centering/head_mass_q": mass.detach().float()}


def centered_logp(logp: Tensor, center: Tensor) -> Tensor:
    """log p(y) with the centred score as its gradient: ``logp − c + sg(c)`` (value exactly ``logp``; ``[B, T]``).

    >>> z = torch.tensor([0.0, 0.0], requires_grad=True)
    >>> logp = torch.log_softmax(z, -1)[0]                        # y = token 0
    >>> lc = centered_logp(logp, score_center(z, torch.tensor([1.0, 0.0]).log()))  # q = onehot(0) = onehot(y)
    >>> lc.item() == logp.item(), torch.autograd.grad(lc, z)[0]   # onehot(y) − q = 0: nothing left to learn
    (True, tensor([0., 0.]))
    """
    if not isinstance(center, Tensor) or center.shape != logp.shape:
        raise ValueError(f"center must have logp's shape {tuple(logp.shape)}, got {getattr(center, 'shape', None)}")
    return logp + (center.detach() - center)


def sampler_topk(sampler_logits: Tensor, k: int, *, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """The sampler's top-k head ``(ids, normalised log-probs)`` ``[..., K]`` from its full logits (what a vLLM /
    SGLang engine returns with ``logprobs=k``)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    logq = torch.log_softmax(sampler_logits.detach().float() / check_positive("temperature", temperature), -1)
    values, ids = logq.topk(min(k, logq.shape[-1]), dim=-1)
    return ids, values


class TailGap(NamedTuple):
    """Per position ``[...]``: ``drift`` ½‖q − p‖₁, ``gap`` ½‖q − q̂‖₁ and ``head_mass_q`` m_q = Σ_H q (no gradient)."""

    drift: Tensor
    gap: Tensor
    head_mass_q: Tensor


@torch.no_grad()
def topk_tail_gap(logits: Tensor, sampler_logits: Tensor, k: int, *, temperature: float = 1.0,
                  memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> TailGap:
    """``(drift, gap, head_mass_q)`` per position ``[...]``: drift = ½‖q − p‖₁, the size of the term score centering
    removes (its logit-space direction is q − p); gap = ½‖q − q̂‖₁, the part the top-k proportional tail gets wrong
    (the top-k centring's logit gradient differs from the exact one by exactly q − q̂, which is 0 on the head);
    head_mass_q = Σ_H q, the mass of the sampler's top-k head H. Row-chunked: one top-k of q per chunk for all three.

    >>> p_logits = torch.zeros(3)                                # p = ⅓ each
    >>> q_logits = torch.tensor([0.6, 0.3, 0.1]).log()
    >>> drift, gap, mass = topk_tail_gap(p_logits, q_logits, 1)  # q̂ = (0.6, 0.2, 0.2), κ = 0.4/(2/3)
    >>> round(drift.item(), 4), round(gap.item(), 4), round(mass.item(), 4)  # ½(0.2667 + 0.0333 + 0.2333); ½(0.1 + 0.1)
    (0.2667, 0.1, 0.6)
    """
    logits, sampler_logits = _check_pair(logits, sampler_logits)
    t = check_positive("temperature", temperature)
    shape, vocab = logits.shape[:-1], logits.shape[-1]
    flat, flat_q = logits.reshape(-1, vocab), sampler_logits.reshape(-1, vocab)
    drift = flat.new_empty(flat.shape[0], dtype=torch.float32)
    gap, head_mass = torch.empty_like(drift), torch.empty_like(drift)
    for a, b in row_chunks(flat.shape[0], chunk_rows(flat.shape[0], vocab, buffers=4,
                                                     memory_budget_bytes=memory_budget_bytes)):
        p = torch.softmax(flat[a:b].float() / t, -1)
        q = torch.softmax(flat_q[a:b].float() / t, -1)
        top = q.topk(min(k, vocab), -1)
        head = torch.zeros_like(q, dtype=torch.bool).scatter_(-1, top.indices, True)
        tail_q, tail_p = (q * ~head).sum(-1, keepdim=True), (p * ~head).sum(-1, keepdim=True)
        q_hat = torch.where(head, q, tail_q / tail_p.clamp(min=torch.finfo(torch.float32).tiny) * p)
        drift[a:b] = 0.5 * (q - p).abs().sum(-1)
        gap[a:b] = 0.5 * (q - q_hat).abs().sum(-1)
        head_mass[a:b] = top.values.sum(-1)
    return TailGap(drift.reshape(shape), gap.reshape(shape), head_mass.reshape(shape))
