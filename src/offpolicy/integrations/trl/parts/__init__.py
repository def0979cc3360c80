"""The parts of :class:`~offpolicy.integrations.trl.mixin.OffPolicyGRPOMixin`, one family each: the forward under
the engine's sampling recipe (:mod:`.scoring`), top-k TRM and its advice (:mod:`.topk`), ALP's σ around TRL's
optimiser and checkpoints (:mod:`.alp`), TRL's own loss terms and metrics (:mod:`.terms`), the vLLM engine's
arguments and weight-sync check (:mod:`.vllm`), the method settings saved with checkpoints and compared on resume
(:mod:`.resume`), the transforms each loss batch runs through (:mod:`.transforms`).

Each part is a plain class (no TRL import): its methods override TRL's ``GRPOTrainer`` methods and reach TRL's through
``super()``, so they take effect only once composed in front of a ``GRPOTrainer`` in the method resolution order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    TRLBase = Any  # for mypy: the attributes and methods TRL's GRPOTrainer provides, reached through self / super()
else:
    TRLBase = object

__all__ = ["TRLBase"]
