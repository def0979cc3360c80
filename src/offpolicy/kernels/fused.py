"""Chunked per-token statistics of a softmax policy without an ``[N, V]`` tensor.

Given hidden states ``h`` [N, H] and an lm_head ``W`` [V, H] (optional bias [V], temperature τ), the policy at
token n is softmax(z_n) with z_n = (W h_n + b) / τ. This module returns, per token,

===============  ==================================================================================  ======
name             value                                                                               grad
===============  ==================================================================================  ======
``logp``         log π(y_n) = z_y − lse(z)                                                           yes
``entropy``      H(π) = lse(z) − Σ_a π_a z_a                                                         yes
``minp_logp``    log π^mp(y_n) = z_y − lse_S(z), S = {a : z_a ≥ z_max + log ρ}  (DVP Defs 5.1–5.2)     yes
``minp_mass``    Z = Σ_{a∈S} π_a, retained (coverage) mass (DVP Prop 5.5)                            yes
``minp_inside``  y_n ∈ S (bool); where False the DVP ratio is 0: use it as the keep mask             —
``kl``           KL(μ ‖ π) to the rollout distribution μ — exact from rollout logits [N, V], or the    yes
                 top-k coarse-grained lower bound from rollout top-k log-probs [N, K] (see
                 :mod:`offpolicy.divergence`)
``tv``           TV(μ, π) (same two sources; top-k gives a lower bound)                              yes
``max_logit``    z_max (the min-p threshold is z_max + log ρ)                                         —
``logsumexp``    lse(z)                                                                               —
===============  ==================================================================================  ======

How (:mod:`offpolicy.kernels.fused_autograd`, with the per-tile mathematics in :mod:`offpolicy.kernels.fused_tiles`):
a custom ``torch.autograd.Function`` whose forward keeps only per-row statistics (logsumexp, entropy, the
safe set's logsumexp, the rollout's logsumexp …) and whose backward recomputes the logits tile by tile and forms
∂/∂z of every requested output at once, then pushes it through the matmuls into ∂h, ∂W, ∂b. Scratch is bounded by
``memory_budget_bytes`` (:mod:`offpolicy.kernels.chunking`) and reused across chunks. The forward takes full-row
chunks when at least ``ROW_PATH_MIN_ROWS`` rows fit (one pass); otherwise it streams over 2-D tiles with running
max / rescaled sums, plus a second pass for min-p (needs the final max) and exact TV (needs both normalisers). The
backward is always 2-D tiled, so each slice of ∂W is written once per row block. All softmax arithmetic is float32
(float64 if the inputs are float64, which is what ``gradcheck`` needs) whatever the input dtype; bf16/fp16 weights
are up-cast one vocabulary slice at a time, as each tile needs it (never a [V, H] float32 copy). The min-p safe set
is fixed during backpropagation (DVP §5.5). Targets equal to ``ignore_index`` give 0 for every output and no
gradient. The rollout's tensors are data: no gradient.

Gradients w.r.t. z (p = softmax(z), onehot at y; each is multiplied by its output's incoming gradient):
logp → onehot − p; entropy → −p ⊙ (z − lse + H); minp_logp → onehot − p ⊙ 1_S / Z (the contrastive form of
DVP Prop 5.4; for y ∉ S the value z_y − lse_S is a finite stand-in for −∞ and ``minp_inside`` drops the token);
minp_mass → p ⊙ (1_S − Z); kl → p − q (q = μ, or for top-k the coarse-grained q̃: q_i on the k ids, and
q_rest · p / p_rest on the rest); tv → ½ p ⊙ (s − Σ s p), s = sign(p − q) per bucket.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES
from offpolicy.kernels.fused_autograd import _FusedLinearStats, _LogitStats
from offpolicy.kernels.fused_tiles import _AUX_OUTPUTS, DIFF_OUTPUTS, IGNORE_INDEX, _Config


@dataclass(frozen=True)
class TokenStats:
    """Per-token outputs of :func:`fused_token_stats` / :func:`token_stats_from_logits`; None when not requested.

    Every tensor has the leading shape of the targets ([N], or [B, T] from the logits path). ``kl_kind`` is
    ``"exact"`` (full rollout logits), ``"topk"`` (coarse-grained lower bound) or None.
    """

    logp: Tensor | None = None
    entropy: Tensor | None = None
    minp_logp: Tensor | None = None
    minp_mass: Tensor | None = None
    minp_inside: Tensor | None = None
    kl: Tensor | None = None
    tv: Tensor | None = None
    max_logit: Tensor | None = None
    logsumexp: Tensor | None = None
    kl_kind: str | None = None


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------

_WANT_ALIASES = {"minp": ("minp_logp", "minp_mass")}


def _resolve_want(want: Iterable[str] | None, min_p_rho: float | None, kl_source: str | None) -> frozenset[str]:
    if want is None:
        names = {"logp"}
        if min_p_rho is not None:
            names |= {"minp_logp", "minp_mass"}
        if kl_source is not None:
            names.add("kl")
    else:
        if isinstance(want, str):
            want = (want,)
        names = set()
        for w in want:
            names.update(_WANT_ALIASES.get(w, (w,)))
    unknown = names - set(DIFF_OUTPUTS)
    if unknown:
        raise ValueError(f"want has unknown outputs {sorted(unknown)}; choose from {DIFF_OUTPUTS} (or 'minp')")
    if names & {"minp_logp", "minp_mass"} and min_p_rho is None:
        raise ValueError("want asks for minp_logp/minp_mass but min_p_rho is None")
    if names & {"kl", "tv"} and kl_source is None:
        raise ValueError("want asks for kl/tv but neither rollout_logits nor rollout_topk_logp/ids is given")
    return frozenset(names)


def _check_common(n: int, vocab: int, targets: Tensor, temperature: float, min_p_rho: float | None,
                  rollout_logits: Tensor | None, rollout_topk_logp: Tensor | None, rollout_topk_ids: Tensor | None,
                  rollout_temperature: float, memory_budget_bytes: int) -> str | None:
    if not isinstance(targets, Tensor) or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError("targets must be an integer tensor of token ids")
    if targets.shape != (n,):
        raise ValueError(f"targets must have shape ({n},), got {tuple(targets.shape)}")
    for name, t in (("temperature", temperature), ("rollout_temperature", rollout_temperature)):
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {t!r}")
    if min_p_rho is not None and not (isinstance(min_p_rho, (int, float)) and 0 < min_p_rho <= 1):
        raise ValueError(f"min_p_rho must be in (0, 1], got {min_p_rho!r}")
    if memory_budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes must be > 0, got {memory_budget_bytes}")
    if rollout_logits is not None and (rollout_topk_logp is not None or rollout_topk_ids is not None):
        raise ValueError("give either rollout_logits or rollout_topk_logp/rollout_topk_ids, not both")
    if rollout_logits is not None:
        if rollout_logits.shape != (n, vocab):
            raise ValueError(f"rollout_logits must have shape ({n}, {vocab}), got {tuple(rollout_logits.shape)}")
        return "logits"
    if (rollout_topk_logp is None) != (rollout_topk_ids is None):
        raise ValueError("rollout_topk_logp and rollout_topk_ids must be given together")
    if rollout_topk_logp is not None:
        if rollout_topk_logp.dim() != 2 or rollout_topk_logp.shape[0] != n or not rollout_topk_logp.is_floating_point():
            raise ValueError(f"rollout_topk_logp must be a float [{n}, K] tensor, got {tuple(rollout_topk_logp.shape)}")
        assert rollout_topk_ids is not None  # given together (checked above)
        if rollout_topk_ids.shape != rollout_topk_logp.shape or rollout_topk_ids.dtype.is_floating_point:
            raise ValueError("rollout_topk_ids must be an integer tensor with rollout_topk_logp's shape")
        if rollout_topk_logp.shape[1] > vocab:
            raise ValueError(f"rollout_topk_logp has K={rollout_topk_logp.shape[1]} > vocabulary {vocab}")
        return "topk"
    return None


def _to_stats(outs: tuple[Tensor, ...], cfg: _Config, shape: tuple[int, ...]) -> TokenStats:
    named = dict(zip(DIFF_OUTPUTS + _AUX_OUTPUTS, outs))
    keep = set(cfg.want) | {"max_logit", "logsumexp"}
    if cfg.want & {"minp_logp", "minp_mass"}:
        keep.add("minp_inside")
    fields = {k: (v.reshape(shape) if k in keep else None) for k, v in named.items()}
    return TokenStats(**fields, kl_kind=None if cfg.kl_source is None else ("exact" if cfg.kl_source == "logits" else "topk"))


def fused_token_stats(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                      temperature: float = 1.0, want: Iterable[str] | None = None, min_p_rho: float | None = None,
                      rollout_logits: Tensor | None = None, rollout_topk_logp: Tensor | None = None,
                      rollout_topk_ids: Tensor | None = None, rollout_temperature: float = 1.0,
                      ignore_index: int = IGNORE_INDEX,
                      memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> TokenStats:
    """Per-token log-prob, entropy, DVP min-p statistics and KL/TV to the rollout, from hidden states, chunked.

    Shapes: ``hidden`` [N, H], ``weight`` [V, H] (lm_head), ``targets`` [N] (sampled ids; ``ignore_index`` rows give
    0 and no gradient), ``bias`` [V]. Rollout μ: ``rollout_logits`` [N, V] (divided by ``rollout_temperature``; pass
    processed logits/log-probs with the default 1.0), or ``rollout_topk_logp`` [N, K] normalised log-probs with
    ``rollout_topk_ids`` [N, K] (unique per row). ``want`` picks outputs from ``DIFF_OUTPUTS`` (``"minp"`` = both
    min-p outputs); default: logp, plus min-p outputs if ``min_p_rho`` is set, plus kl if a rollout is given.
    Implements: "Dynamic Vocabulary Pruning" (arXiv 2512.23087) Defs 5.1–5.2 and Prop 5.6 for the min-p outputs; the exact token KL
    of Trust Region Masking (arXiv 2512.23075) and its top-k lower bound (:mod:`offpolicy.divergence`) for ``kl``.
    No ``[N, V]`` tensor is kept; at most ``memory_budget_bytes`` of chunk scratch is alive at once.

    >>> _ = torch.manual_seed(0); h, w = torch.randn(4, 8), torch.randn(11, 8); y = torch.tensor([1, 2, -100, 3])
    >>> s = fused_token_stats(h, w, y, want=("logp", "entropy"))
    >>> ref = torch.log_softmax(h @ w.T, -1).gather(1, y.clamp(min=0)[:, None])[:, 0]
    >>> bool(torch.allclose(s.logp[[0, 1, 3]], ref[[0, 1, 3]], atol=1e-5)), s.logp[2].item()
    (True, 0.0)
    """
    if not isinstance(hidden, Tensor) or hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a float [N, H] tensor, got {getattr(hidden, 'shape', type(hidden))}")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, {hidden.shape[1]}], got {getattr(weight, 'shape', type(weight))}")
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (weight.shape[0],)):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {getattr(bias, 'shape', type(bias))}")
    n, vocab = hidden.shape[0], weight.shape[0]
    source = _check_common(n, vocab, targets, temperature, min_p_rho, rollout_logits, rollout_topk_logp,
                           rollout_topk_ids, rollout_temperature, memory_budget_bytes)
    cfg = _Config(_resolve_want(want, min_p_rho, source), float(temperature),
                  math.log(min_p_rho) if min_p_rho is not None else 0.0, float(rollout_temperature), source,
                  int(ignore_index), int(memory_budget_bytes))
    def detach(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach()

    outs = _FusedLinearStats.apply(hidden, weight, bias, targets, detach(rollout_logits), detach(rollout_topk_logp),
                                   detach(rollout_topk_ids), cfg)
    return _to_stats(outs, cfg, (n,))


def fused_logp(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
               temperature: float = 1.0, ignore_index: int = IGNORE_INDEX,
               memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> Tensor:
    """log π(y_n) [N] from hidden states [N, H] and lm_head [V, H], chunked (see :func:`fused_token_stats`).

    >>> h, w = torch.zeros(2, 3), torch.zeros(4, 3)           # uniform policy over 4 tokens: log(1/4)
    >>> fused_logp(h, w, torch.tensor([0, 3]))
    tensor([-1.3863, -1.3863])
    """
    logp = fused_token_stats(hidden, weight, targets, bias=bias, temperature=temperature, want=("logp",),
                             ignore_index=ignore_index, memory_budget_bytes=memory_budget_bytes).logp
    assert logp is not None  # requested
    return logp


def token_stats_from_logits(logits: Tensor, targets: Tensor, *, temperature: float = 1.0,
                            want: Iterable[str] | None = None, min_p_rho: float | None = None,
                            rollout_logits: Tensor | None = None, rollout_topk_logp: Tensor | None = None,
                            rollout_topk_ids: Tensor | None = None, rollout_temperature: float = 1.0,
                            ignore_index: int = IGNORE_INDEX,
                            memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> TokenStats:
    """Same statistics as :func:`fused_token_stats` from logits that already exist, ``[..., V]`` → ``[...]``.

    Row-chunked, so the only ``[..., V]`` tensors are the inputs (and, in backward, their gradient). Rollout tensors
    have the logits' leading shape: ``rollout_logits`` [..., V], ``rollout_topk_logp``/``ids`` [..., K].

    >>> z = torch.tensor([[[2.0, 0.0, -30.0]]])                    # [B=1, T=1, V=3]
    >>> s = token_stats_from_logits(z, torch.tensor([[1]]), min_p_rho=1e-6)
    >>> round(s.logp.item(), 4), round(s.minp_logp.item(), 4), bool(s.minp_inside)   # token 2 is pruned
    (-2.1269, -2.1269, True)
    """
    if not isinstance(logits, Tensor) or logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [..., V] tensor, got {getattr(logits, 'shape', type(logits))}")
    lead, vocab = tuple(logits.shape[:-1]), logits.shape[-1]
    if not isinstance(targets, Tensor) or tuple(targets.shape) != lead:
        raise ValueError(f"targets must have shape {lead}, got {getattr(targets, 'shape', type(targets))}")
    n = math.prod(lead)
    def flat(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach().reshape(n, t.shape[-1])

    roll, tkl, tki = flat(rollout_logits), flat(rollout_topk_logp), flat(rollout_topk_ids)
    for name, orig in (("rollout_logits", rollout_logits), ("rollout_topk_logp", rollout_topk_logp)):
        if orig is not None and tuple(orig.shape[:-1]) != lead:
            raise ValueError(f"{name} must have leading shape {lead}, got {tuple(orig.shape)}")
    source = _check_common(n, vocab, targets.reshape(n), temperature, min_p_rho, roll, tkl, tki,
                           rollout_temperature, memory_budget_bytes)
    cfg = _Config(_resolve_want(want, min_p_rho, source), float(temperature),
                  math.log(min_p_rho) if min_p_rho is not None else 0.0, float(rollout_temperature), source,
                  int(ignore_index), int(memory_budget_bytes))
    outs = _LogitStats.apply(logits.reshape(n, vocab), targets.reshape(n), roll, tkl, tki, cfg)
    return _to_stats(outs, cfg, lead)
