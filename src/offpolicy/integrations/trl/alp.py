"""ALP (arXiv 2603.19470 §3.2) inside TRL: σ's gradient across processes, its optimiser-step bookkeeping, and its
checkpoint file.

σ (``LayerwisePerturbation.log_sigma``) lives outside the model — the model's ``state_dict``, ``save_pretrained``
and TRL's vLLM weight sync never see it — so the HF Trainer neither all-reduces its gradient (DDP / FSDP wrap the
model only) nor zeroes it (``model.zero_grad()``), nor saves it. :func:`alp_callback` does the first two around the
optimiser step; :func:`save_alp` / :func:`load_alp` write and read ``offpolicy_alp.pt`` in a checkpoint folder.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from offpolicy.integrations.trl.ranks import world_size
from offpolicy.perturbation import LayerwisePerturbation

ALP_CHECKPOINT_FILE = "offpolicy_alp.pt"


def allreduce_sigma_grad(alp: LayerwisePerturbation, group: Any = None) -> bool:
    """Average ``alp.log_sigma.grad`` over the processes of ``group`` (None: the default group; a list: each group
    in turn — averaging over each dimension of a mesh averages over all of it) when torch.distributed is initialised
    with more than one process; a process without a gradient contributes zeros (so no rank waits forever). Returns
    True when it communicated.

    >>> alp = LayerwisePerturbation(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Identity()])))
    >>> allreduce_sigma_grad(alp)       # not distributed: nothing to do
    False
    """
    groups = group if isinstance(group, list) else [group]
    communicated = False
    for g in groups:
        processes = world_size(g)
        if processes == 1:
            continue
        if alp.log_sigma.grad is None:
            alp.log_sigma.grad = torch.zeros_like(alp.log_sigma)
        dist.all_reduce(alp.log_sigma.grad, op=dist.ReduceOp.SUM, group=g)
        alp.log_sigma.grad.div_(processes)
        communicated = True
    return communicated


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


def save_alp(alp: LayerwisePerturbation, folder: str | os.PathLike) -> str:
    """Write σ and the noise generators' states to ``folder/offpolicy_alp.pt``; returns the path."""
    path = os.path.join(folder, ALP_CHECKPOINT_FILE)
    torch.save({"state_dict": alp.state_dict(), "generators": alp.generator_states()}, path)
    return path


def load_alp(alp: LayerwisePerturbation, folder: str | os.PathLike) -> None:
    """Restore what :func:`save_alp` wrote (σ in place: the optimiser keeps the same parameter)."""
    path = os.path.join(folder, ALP_CHECKPOINT_FILE)
    if not os.path.exists(path):
        raise ValueError(f"resume_from_checkpoint: {folder} has no {ALP_CHECKPOINT_FILE} (σ of ALP); it was not "
                         "written by an OffPolicyGRPOTrainer with alp=")
    state = torch.load(path, map_location=alp.log_sigma.device, weights_only=True)
    alp.load_state_dict(state["state_dict"])
    alp.set_generator_states(state["generators"])
