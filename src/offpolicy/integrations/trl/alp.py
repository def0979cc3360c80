"""ALP (arXiv 2603.19470 §3.2) inside TRL: σ's gradient across processes, its optimiser-step bookkeeping, and its
checkpoint file.

σ (``LayerwisePerturbation.log_sigma``) lives outside the model — the model's ``state_dict``, ``save_pretrained``
and TRL's vLLM weight sync never see it — so the HF Trainer neither all-reduces its gradient (DDP / FSDP wrap the
model only) nor zeroes it (``model.zero_grad()``), nor saves it. :func:`alp_callback` does the first two around the
optimiser step; :func:`save_alp` / :func:`load_alp` write and read ``offpolicy_alp.pt`` in a checkpoint folder.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from offpolicy.integrations.trl.ranks import world_size
from offpolicy.perturbation import LayerwisePerturbation

ALP_CHECKPOINT_FILE = "offpolicy_alp.pt"


def allreduce_sigma_grad(alp: LayerwisePerturbation, group: Any = None) -> bool:
    """Average ``alp.log_sigma.grad`` over the processes of ``group`` (the default group) when torch.distributed is
    initialised with more than one process; a process without a gradient contributes zeros (so no rank waits
    forever). Returns True when it communicated.

    >>> alp = LayerwisePerturbation(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Identity()])))
    >>> allreduce_sigma_grad(alp)       # not distributed: nothing to do
    False
    """
    processes = world_size(group)
    if processes == 1:
        return False
    if alp.log_sigma.grad is None:
        alp.log_sigma.grad = torch.zeros_like(alp.log_sigma)
    dist.all_reduce(alp.log_sigma.grad, op=dist.ReduceOp.SUM, group=group)
    alp.log_sigma.grad.div_(processes)
    return True


class ALPSigmaHooks:
    """The two optimiser-step events of :func:`alp_callback`'s callback: before the step σ's gradient is all-reduced
    (:func:`allreduce_sigma_grad`), after it σ's gradient is dropped (the Trainer zeroes only the model's). Plain (no
    transformers import here): :func:`alp_callback` puts it in front of ``transformers.TrainerCallback``."""

    def __init__(self, alp: LayerwisePerturbation) -> None:
        self.alp = alp

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        allreduce_sigma_grad(self.alp)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.alp.log_sigma.grad = None


def alp_callback(alp: LayerwisePerturbation) -> Any:
    """A ``transformers.TrainerCallback`` with :class:`ALPSigmaHooks`' two events (the callback's other events are
    ``TrainerCallback``'s no-ops)."""
    from transformers import TrainerCallback

    return type("ALPSigmaCallback", (ALPSigmaHooks, TrainerCallback), {"__module__": __name__})(alp)


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
