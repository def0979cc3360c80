"""The result every correction returns, the ``Correction`` wrapper, and ``chain``.

A *correction* is a small named function ``LogProbBatch -> CorrectionResult`` (optax style: factories return pure
functions, variants are wrappers, not mode strings). Its result carries

* ``weights``  [B, T] float32, detached — multiplies each token's loss term (1 = untouched);
* ``keep``     [B, T] bool — False drops the token (or whole sequence) from the loss numerator;
* ``metrics``  dict of 0-d tensors, prefixed with the correction's name — never synced here;
* ``shared``   per-token terms the correction already computed (e.g. the cleaned log(π_old/μ)), keyed by what they
  are, for the diagnostics to reuse instead of recomputing (``offpolicy_metrics(..., weights=result)``).

Dropped tokens keep their place in the loss *denominator* (the padding mask decides it, not ``keep``): this is the
Trust-Region-Masking convention (normalise by the total batch, arXiv 2512.23075) and keeps the loss scale stable when
a correction drops much of a batch.

``chain(a, b, c)`` multiplies weights and ANDs keep masks in order; its result equals applying them one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.ratios import float_mask, mask_factor


@dataclass(frozen=True)
class CorrectionResult:
    """Weights [B, T] (detached float32), keep mask [B, T] (bool) and metric tensors of one correction."""

    weights: Tensor
    keep: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    shared: dict[object, object] = field(default_factory=dict, repr=False, compare=False)
    keep_factor: Tensor | None = field(default=None, repr=False, compare=False)  # keep as float 0/1, if at hand
    # the level of the importance ratio the weights carry ("token" / "sequence" / "geometric", "mixed" in a chain of
    # several), or None when the weights are only the padding mask (a pure mask: opsm, veto, trm, …). It tells
    # offpolicy_metrics what "clipped" means; a custom correction is taken to reweight at token level.
    weight_level: str | None = field(default="token", repr=False, compare=False)

    def keep_multiplicand(self) -> Tensor:
        """``keep`` as a cheap 0/1 multiplicand: ``keep_factor`` when the correction produced one (a chain under
        ``torch.compile`` does), else :func:`~offpolicy.ratios.mask_factor` of ``keep``."""
        return self.keep_factor if self.keep_factor is not None else mask_factor(self.keep)

    @property
    def coefficient(self) -> Tensor:
        """weights · keep: the per-token factor the loss multiplies in (0 where dropped)."""
        return torch.where(self.keep, self.weights, torch.zeros_like(self.weights))

    @staticmethod
    def identity(batch: LogProbBatch) -> "CorrectionResult":
        """Weights 1 on valid tokens, keep = mask: what "no correction" means."""
        m = batch.bool_mask
        return CorrectionResult(weights=float_mask(m), keep=m.clone(), metrics={}, weight_level=None)

    def then(self, other: "CorrectionResult") -> "CorrectionResult":
        """Compose: weights multiply, masks AND, metrics merge (later names win), shared terms merge."""
        return CorrectionResult(
            weights=self.weights * other.weights,
            keep=self.keep & other.keep,
            metrics={**self.metrics, **other.metrics},
            shared={**self.shared, **other.shared},
            weight_level=combined_weight_level(self.weight_level, other.weight_level),
        )


def combined_weight_level(a: str | None, b: str | None) -> str | None:
    """:attr:`CorrectionResult.weight_level` of two results composed: a pure mask (None) adds no ratio.

    >>> combined_weight_level(None, "token"), combined_weight_level("token", "geometric")
    ('token', 'mixed')
    """
    if a is None or a == b:
        return b
    return a if b is None else "mixed"


@dataclass(frozen=True)
class Correction:
    """A named correction: ``Correction(name, fn)(batch) -> CorrectionResult``.

    Build them with the presets (:func:`offpolicy.tis`, :func:`offpolicy.mis`, :func:`offpolicy.opsm`, …) or wrap
    any function of your own. ``fn`` must not mutate the batch, sync to host, or return weights with grad.
    """

    name: str
    fn: Callable[[LogProbBatch], CorrectionResult]
    config: dict[str, object] = field(default_factory=dict)
    parts: tuple["Correction", ...] = ()  # set by chain(): the corrections it composes

    def __call__(self, batch: LogProbBatch) -> CorrectionResult:
        if isinstance(batch, LogProbBatch) and batch.logp.numel() == 0:  # B = 0 or T = 0: as an all-masked batch
            r = self.fn(batch.nonempty())
            rows, cols = batch.logp.shape
            return CorrectionResult(r.weights.detach()[:rows, :cols], r.keep[:rows, :cols], r.metrics,
                                    weight_level=r.weight_level)
        r = self.fn(batch)
        return CorrectionResult(r.weights.detach(), r.keep, r.metrics, r.shared, r.keep_factor, r.weight_level)

    def __repr__(self) -> str:
        if self.parts:
            return f"{self.name}({', '.join(repr(c) for c in self.parts)})"
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"{self.name}({args})"


def chain(*corrections: Correction) -> Correction:
    """Compose corrections: weights multiply, keep masks AND, in order. ``chain()`` is the identity.

    Every correction sees the *original* batch (none reads another's output), so the result equals applying them
    one by one and combining with :meth:`CorrectionResult.then`.

    >>> from offpolicy.corrections.importance import tis, icepop
    >>> c = chain(tis(upper=2.0), icepop())
    >>> c
    chain(tis(level='token', lower=None, upper=2.0, normalize=False, source='mismatch'), icepop(lower=0.5, upper=5.0, source='mismatch'))
    """
    for i, c in enumerate(corrections):
        if not isinstance(c, Correction):
            raise ValueError(f"chain argument {i} must be a Correction, got {type(c).__name__}")

    def apply(batch: LogProbBatch) -> CorrectionResult:
        # The parts share terms through the batch's memo (LogProbBatch.memo). A private copy scopes that memo to this
        # call: the shared [B, T] buffers are freed when the chain returns (except the few the parts hand on in
        # ``shared`` for the diagnostics), so the loss that follows reuses their memory instead of faulting in fresh
        # pages (a large part of the cost on CPU).
        scoped = batch.replace() if isinstance(batch, LogProbBatch) else batch
        # CorrectionResult.then, accumulated in place into the identity's fresh tensors: the same products in the same
        # order (so the same numbers), without a new [B, T] weight and keep buffer per correction
        identity = CorrectionResult.identity(scoped)
        weights, keep, metrics, shared, level = identity.weights, identity.keep, {}, {}, None
        # Under torch.compile the combined keep mask is carried as float 0/1 (keep_factor) and the bool ``keep`` is
        # a comparison on it: inductor's CPU code stores a bool [B, T] buffer with a scalar loop (~10× a float pass),
        # and a mask read by several kernels (the count below, the loss, the metrics) is stored. The consumers read
        # keep_factor; the bool comparison fuses into whoever still reads ``keep``.
        compiling = torch.compiler.is_compiling()
        keep_factor = identity.weights.clone() if compiling else None
        for c in corrections:
            r = c(scoped)
            same = (
                r.weights.dtype == weights.dtype and r.weights.shape == weights.shape
                and r.keep.dtype == torch.bool and r.keep.shape == keep.shape
            )
            weights = weights.mul_(r.weights) if same else weights * r.weights  # a custom fn may return other dtypes
            if keep_factor is not None:
                keep_factor = keep_factor * r.keep_multiplicand()
            else:
                keep = keep.logical_and_(r.keep) if same else keep & r.keep
            # a nested chain's own summary is superseded by this one's; any other shared key is two parts of one name
            part_metrics = {k: v for k, v in r.metrics.items() if not k.startswith("chain/")}
            clash = metrics.keys() & part_metrics.keys()
            if clash:
                raise ValueError(
                    f"chain: {c!r} reports metrics that an earlier part already reported ({', '.join(sorted(clash))}): "
                    "two parts of the same name would overwrite each other's metrics; name one differently "
                    "(importance_correction(..., name=...))"
                )
            metrics = {**metrics, **part_metrics}
            shared = {**shared, **r.shared}
            level = combined_weight_level(level, r.weight_level)
        if keep_factor is not None:
            keep = keep_factor != 0
            n_kept = keep_factor.sum()
        else:  # count_nonzero: a bool→float cast of [B, T] just to sum it costs ~10× as much on CPU
            n_kept = torch.count_nonzero(keep).float()
        kept = n_kept / torch.count_nonzero(scoped.bool_mask).float().clamp(min=1.0)
        return CorrectionResult(weights, keep, {**metrics, "chain/kept_token_frac": kept}, shared, keep_factor, level)

    return Correction("chain", apply, {}, parts=tuple(corrections))
