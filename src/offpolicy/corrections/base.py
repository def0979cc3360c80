"""The result every correction returns, the ``Correction`` wrapper, and ``chain``.

A *correction* is a small named function ``LogProbBatch -> CorrectionResult`` (optax style: factories return pure
functions, variants are wrappers, not mode strings). Its result carries

* ``weights``  [B, T] float32, detached — multiplies each token's loss term (1 = untouched);
* ``keep``     [B, T] bool — False drops the token (or whole sequence) from the loss numerator;
* ``metrics``  dict of 0-d tensors, prefixed with the correction's name — never synced here;
* ``weight_level`` what the weights are: the level of the importance ratio they carry (``"token"`` /
  ``"sequence"`` / ``"geometric"``, ``"mixed"`` in a chain of several), or None for a pure mask (opsm, veto, trm …,
  whose weights are only the padding mask; also a weight that carries no ratio, the delight gate's σ(A·surprisal)).
  :func:`~offpolicy.offpolicy_metrics` reads it to tell "truncated" from "masked".

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

from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.ratios import count, float_mask, zero_outside


@dataclass(frozen=True)
class CorrectionResult:
    """Weights [B, T] (detached float32), keep mask [B, T] (bool) and metric tensors of one correction."""

    weights: Tensor
    keep: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    # a custom correction is taken to reweight at token level; pure masks say None (see the module docstring)
    weight_level: str | None = field(default="token", repr=False, compare=False)

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
        """Compose: weights multiply, masks AND, metrics merge (later names win)."""
        return CorrectionResult(
            weights=self.weights * other.weights,
            keep=self.keep & other.keep,
            metrics={**self.metrics, **other.metrics},
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
    """A named correction: ``Correction(name, fn, config)(batch) -> CorrectionResult``.

    Build them with the registered factories (:func:`offpolicy.tis`, :func:`offpolicy.mis`, :func:`offpolicy.opsm`, …,
    or by name with :func:`offpolicy.build_correction`) or wrap any function of your own. ``fn`` must not mutate the
    batch, sync to host, or return weights with grad. ``config`` is what the repr shows (the factory's parameters).
    """

    name: str
    fn: Callable[[LogProbBatch], CorrectionResult]
    config: dict[str, object] = field(default_factory=dict)
    parts: tuple[Correction, ...] = ()  # set by chain(): the corrections it composes

    def __call__(self, batch: LogProbBatch) -> CorrectionResult:
        if isinstance(batch, LogProbBatch) and batch.logp.numel() == 0:  # B = 0 or T = 0: as an all-masked batch
            r = self.fn(batch.nonempty())
            rows, cols = batch.logp.shape
            return CorrectionResult(r.weights.detach()[:rows, :cols], r.keep[:rows, :cols], r.metrics, r.weight_level)
        r = self.fn(batch)
        return CorrectionResult(r.weights.detach(), r.keep, r.metrics, r.weight_level)

    def __repr__(self) -> str:
        if self.parts:
            return f"{self.name}({', '.join(repr(c) for c in self.parts)})"
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"{self.name}({args})"


def chain(*corrections: Correction) -> Correction:
    """Compose corrections: weights multiply, keep masks AND, in order. ``chain()`` is the identity.

    Every correction sees the *original* batch (none reads another's output), so the result equals applying them
    one by one and combining with :meth:`CorrectionResult.then`. Adds ``chain/kept_token_frac`` (kept / valid tokens).

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
            combined = combined.then(CorrectionResult(part.weights, part.keep, part_metrics, part.weight_level))
        kept = count(combined.keep) / count(batch.bool_mask).clamp(min=1)
        return CorrectionResult(combined.weights, combined.keep, {**combined.metrics, "chain/kept_token_frac": kept},
                                combined.weight_level)

    return Correction("chain", apply, {}, parts=tuple(corrections))
