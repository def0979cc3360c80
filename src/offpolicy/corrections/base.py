"""The result every correction returns, the ``Correction`` wrapper, and ``chain``.

A *correction* is a small named function ``LogProbBatch -> CorrectionResult`` (optax style: factories return pure
functions, variants are wrappers, not mode strings). Its result carries

* ``weights``  [B, T] float32, detached — multiplies each token's loss term (1 = untouched);
* ``keep``     [B, T] bool — False drops the token (or whole sequence) from the loss numerator;
* ``metrics``  dict of 0-d tensors, prefixed with the correction's name — never synced here;
* ``capped``   [B, T] bool or None — the kept tokens whose weight the correction *truncated* to a bound (TIS's cap,
  calibrated IS's, a gate in ``truncate`` mode); None: it truncates nothing;
* ``weight_level`` what the weights are: the level of the importance ratio they carry (``"token"`` /
  ``"sequence"`` / ``"geometric"``, ``"mixed"`` in a chain of several), or None for a pure mask (opsm, veto, trm …,
  whose weights are only the padding mask; also a weight that carries no ratio, the delight gate's σ(A·surprisal)).
  :func:`~offpolicy.offpolicy_metrics` reads it to tell "truncated" from "masked".

What a correction drops or caps is logged under the same four names by every correction, computed here once from its
result (:func:`drop_metrics`; the wrapper :class:`Correction` adds them): ``<name>/kept_frac``, ``<name>/masked_frac``,
``<name>/capped_frac`` (per valid token, summing to 1) and ``<name>/masked_seq_frac`` (per non-empty sequence).

Dropped tokens keep their place in the loss *denominator* (the padding mask decides it, not ``keep``): this is the
Trust-Region-Masking convention (normalise by the total batch, arXiv 2512.23075 §4) and keeps the loss scale stable
when a correction drops much of a batch.

``chain(a, b, c)`` multiplies weights and ANDs keep masks in order; its result equals applying them one by one.
Corrections are registered by name (:func:`offpolicy.register_correction`) and built from data with
:func:`offpolicy.build_correction`, so a chain can be rebuilt between steps with new parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.ratios import as_mask, count, float_mask, mean_over_sequences, zero_outside

DROP_NAMES: tuple[str, ...] = ("kept_frac", "masked_frac", "capped_frac", "masked_seq_frac")


@dataclass(frozen=True)
class CorrectionResult:
    """Weights [B, T] (detached float32), keep mask [B, T] (bool) and metric tensors of one correction."""

    weights: Tensor
    keep: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    # a custom correction is taken to reweight at token level; pure masks say None (see the module docstring)
    weight_level: str | None = field(default="token", repr=False, compare=False)
    # the kept tokens whose weight was truncated to a bound [B, T] bool; None: nothing truncated
    capped: Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def coefficient(self) -> Tensor:
        """weights · keep: the per-token factor the loss multiplies in (0 where dropped; a non-finite weight is 0)."""
        return zero_outside(self.weights.float(), self.keep)

    @staticmethod
    def identity(batch: LogProbBatch) -> CorrectionResult:
        """Weights 1 on valid tokens, keep = mask: what "no correction" means."""
        valid = batch.bool_mask
        return CorrectionResult(weights=float_mask(valid), keep=valid.clone(), metrics={}, weight_level=None)

    def then(self, other: CorrectionResult) -> CorrectionResult:
        """Compose: weights multiply, masks AND, metrics merge (later names win), a token capped by either is capped."""
        if self.capped is None or other.capped is None:
            capped = other.capped if self.capped is None else self.capped
        else:
            capped = self.capped | other.capped
        return CorrectionResult(
            weights=self.weights * other.weights,
            keep=self.keep & other.keep,
            metrics={**self.metrics, **other.metrics},
            weight_level=combined_weight_level(self.weight_level, other.weight_level),
            capped=capped,
        )


def drop_metrics(name: str, result: CorrectionResult, mask: Tensor) -> dict[str, Tensor]:
    """What a correction did to the valid tokens (mask = 1; padding never counts), as 0-d float32 tensors:

    * ``<name>/masked_frac``  share of valid tokens whose coefficient weights·keep is 0 — dropped from the loss
      numerator (keep False, a weight of 0, or a non-finite weight);
    * ``<name>/capped_frac``  share of valid tokens still in the loss whose weight was truncated to a bound
      (``result.capped``; 0 for a correction that truncates nothing);
    * ``<name>/kept_frac``    share of valid tokens neither masked nor capped, so kept + masked + capped = 1 — a token
      whose weight is the ratio itself, a mask's surviving token, a gate's reweighted one;
    * ``<name>/masked_seq_frac``  share of sequences with ≥ 1 valid token whose every valid token is masked.

    All are per token, whatever level the correction decides at: a sequence mask's dropped sequence counts each of
    its valid tokens. No valid token: kept_frac 1, the others 0 (the on-policy values).

    >>> r = CorrectionResult(torch.tensor([[1.0, 2.0, 0.0], [1.0, 1.0, 5.0]]),
    ...                      torch.tensor([[True, True, False], [False, False, True]]),
    ...                      capped=torch.tensor([[False, True, False], [False, False, False]]))
    >>> m = drop_metrics("c", r, torch.tensor([[1, 1, 1], [1, 1, 0]]))   # 5 valid tokens; the 5.0 is padding
    >>> {k: round(v.item(), 2) for k, v in m.items()}   # kept 1, capped 1, masked 3; row 1 wholly masked
    {'c/kept_frac': 0.2, 'c/masked_frac': 0.6, 'c/capped_frac': 0.2, 'c/masked_seq_frac': 0.5}
    """
    valid = as_mask(mask)
    live = valid & (result.coefficient != 0)  # still in the numerator
    capped = live & result.capped if result.capped is not None else torch.zeros_like(live)
    n_valid = count(valid)
    n = n_valid.clamp(min=1)
    nonempty = count(valid, dim=-1) > 0
    return {
        f"{name}/kept_frac": torch.where(n_valid > 0, count(live & ~capped) / n, 1.0),
        f"{name}/masked_frac": count(valid & ~live) / n,
        f"{name}/capped_frac": count(capped) / n,
        f"{name}/masked_seq_frac": mean_over_sequences(nonempty & (count(live, dim=-1) == 0), nonempty),
    }


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
    """A named correction: ``Correction(name, fn, config)(batch) -> CorrectionResult``.

    Build them with the registered factories (:func:`offpolicy.tis`, :func:`offpolicy.mis`, :func:`offpolicy.opsm`, …,
    or by name with :func:`offpolicy.build_correction`) or wrap any function of your own. ``fn`` must not mutate the
    batch, sync to host, or return weights with grad. ``config`` is what the repr shows (the factory's parameters).
    Calling it adds :func:`drop_metrics` under ``name`` to the result's metrics (those four names are the wrapper's:
    they replace any of the same key ``fn`` returns; ``logs_drops=False`` leaves them out); a function whose weights
    truncate a ratio says where in ``CorrectionResult.capped``.
    """

    name: str
    fn: Callable[[LogProbBatch], CorrectionResult]
    config: dict[str, object] = field(default_factory=dict)
    parts: tuple[Correction, ...] = ()  # set by chain(): the corrections it composes
    # False: no drop_metrics under this name (a host's own factors that cannot say which weights they truncate)
    logs_drops: bool = field(default=True, repr=False)

    def __call__(self, batch: LogProbBatch) -> CorrectionResult:
        if isinstance(batch, LogProbBatch) and batch.logp.numel() == 0:  # B = 0 or T = 0: as an all-masked batch
            r = self.fn(batch.nonempty())
            rows, cols = batch.logp.shape
            capped = None if r.capped is None else r.capped[:rows, :cols]
            r = CorrectionResult(r.weights.detach()[:rows, :cols], r.keep[:rows, :cols], r.metrics, r.weight_level,
                                 capped)
        else:
            r = self.fn(batch)
            r = CorrectionResult(r.weights.detach(), r.keep, r.metrics, r.weight_level, r.capped)
        if not self.logs_drops or not isinstance(batch, LogProbBatch):  # (not a batch: nothing to count against)
            return r
        metrics = {**r.metrics, **drop_metrics(self.name, r, batch.bool_mask)}
        return CorrectionResult(r.weights, r.keep, metrics, r.weight_level, r.capped)

    def __repr__(self) -> str:
        if self.parts:
            return f"{self.name}({', '.join(repr(c) for c in self.parts)})"
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"{self.name}({args})"


def chain(*corrections: Correction) -> Correction:
    """Compose corrections: weights multiply, keep masks AND, in order. ``chain()`` is the identity.

    Every correction sees the *original* batch (none reads another's output), so the result equals applying them
    one by one and combining with :meth:`CorrectionResult.then`. Its own :func:`drop_metrics` (``chain/kept_frac`` …)
    are those of the combined result; a nested chain's are left out.

    >>> from offpolicy.corrections.importance import tis, icepop
    >>> c = chain(tis(upper=2.0), icepop())
    >>> c
    chain(tis(level='token', lower=None, upper=2.0, normalize=False, source='mismatch'), icepop(lower=0.5, upper=5.0, source='mismatch'))
    """
    for i, c in enumerate(corrections):
        if not isinstance(c, Correction):
            raise ValueError(f"chain argument {i} must be a Correction, got {type(c).__name__}")

    def apply(batch: LogProbBatch) -> CorrectionResult:
        combined = CorrectionResult.identity(batch)
        for c in corrections:
            part = c(batch)
            # a nested chain's own summary is superseded by this one's; any other shared key is two parts of one name
            part_metrics = {k: v for k, v in part.metrics.items() if not k.startswith("chain/")}
            clash = combined.metrics.keys() & part_metrics.keys()
            if clash:
                raise ValueError(
                    f"chain: {c!r} reports metrics that an earlier part already reported ({', '.join(sorted(clash))}): "
                    "two parts of the same name would overwrite each other's metrics; name one differently "
                    "(importance_correction(..., name=...))"
                )
            combined = combined.then(CorrectionResult(part.weights, part.keep, part_metrics, part.weight_level,
                                                      part.capped))
        return combined

    return Correction("chain", apply, {}, parts=tuple(corrections))
