"""ALP (arXiv 2603.19470 §3.2) inside TRL: σ's gradient across processes and its optimiser-step bookkeeping.

σ (``LayerwisePerturbation.log_sigma``) lives outside the model — the model's ``state_dict``, ``save_pretrained``
and TRL's vLLM weight sync never see it — so the HF Trainer neither all-reduces its gradient (DDP / FSDP wrap the
model only) nor zeroes it (``model.zero_grad()``), nor saves it. :func:`alp_callback` does the first two around the
optimiser step (:func:`offpolicy.perturbation.allreduce_sigma_grad`); σ's checkpoint file is
:func:`offpolicy.perturbation.save_alp`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from offpolicy.perturbation import LayerwisePerturbation, allreduce_sigma_grad


class ALPSigmaHooks:
    """The two optimiser-step events of :func:`alp_callback`'s callback: before the step σ's gradient is all-reduced
    over the groups the model's gradients are averaged over (:func:`allreduce_sigma_grad`,
    :func:`~offpolicy.integrations.trl.parts.sharding.training_groups` of ``model()``, the trained model as the
    Trainer wrapped it; the default group without ``model``), after it σ's gradient is dropped (the Trainer zeroes
    only the model's). Plain (no transformers import here): :func:`alp_callback` puts it in front of
    ``transformers.TrainerCallback``."""

    def __init__(self, alp: LayerwisePerturbation, model: Callable[[], Any] | None = None) -> None:
        self.alp = alp
        self.model = model

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from offpolicy.integrations.trl.parts.sharding import training_groups

        allreduce_sigma_grad(self.alp, training_groups(self.model()) if self.model is not None else None)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.alp.log_sigma.grad = None


def alp_callback(alp: LayerwisePerturbation, model: Callable[[], Any] | None = None) -> Any:
    """A ``transformers.TrainerCallback`` with :class:`ALPSigmaHooks`' two events (the callback's other events are
    ``TrainerCallback``'s no-ops); ``model`` returns the trained model as wrapped (``trainer.model_wrapped``)."""
    from transformers import TrainerCallback

    return type("ALPSigmaCallback", (ALPSigmaHooks, TrainerCallback), {"__module__": __name__})(alp, model)
