"""The toy GRPO data of the TRL ``train()`` tests and the live TRL scripts, and what they read back from TRL's log."""

from __future__ import annotations


def toy_dataset():
    """8 arithmetic prompts ``"i+i="`` with their answers."""
    import datasets

    return datasets.Dataset.from_list([{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)])


def varied_reward(completions, answer, **kwargs):
    """Rewards that vary within a group, so that the advantages (and the gradients) are not all zero."""
    return [float(len(c)) % 3 + float(c.strip().startswith(a)) for c, a in zip(completions, answer)]


def logged(trainer, key):
    """Every value TRL logged under ``key`` during ``trainer.train()``, in step order."""
    return [h[key] for h in trainer.state.log_history if key in h]


def arithmetic_dataset(n: int = 8, seed: int = 0):
    """``n`` prompts of the built-in arithmetic task (what the embedded tiny model was trained on: it answers them with
    a spread of numbers, so a group's rewards vary), with their answers."""
    import datasets

    from offpolicy.tasks import get_task

    return datasets.Dataset.from_list([{"prompt": e.prompt, "answer": e.answer}
                                       for e in get_task("arithmetic").examples(n, seed=seed)])


def train_recording_sync_failure(trainer, entry: dict) -> None:
    """``trainer.train()``, recording in ``entry`` the sync check's error (None when every sync passed), the step it
    stopped at, and whether any weight moved."""
    import torch

    from offpolicy.rollout.sync_check import SyncCheckError

    before = [p.detach().clone() for p in trainer.model.parameters()]
    try:
        trainer.train()
        entry["error"] = None
    except SyncCheckError as err:
        entry["error"] = str(err)
        entry["failed_at_step"] = trainer.state.global_step
    entry["moved"] = any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def toy_step_inputs():
    """A two-row batch in the shape TRL's ``_compute_loss`` takes (prompts, completions with padding, advantages,
    π_old and vLLM's μ)."""
    import torch

    return {
        "prompt_ids": torch.tensor([[5, 6], [5, 7]]),
        "prompt_mask": torch.ones(2, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[1, 2, 3], [1, 2, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "advantages": torch.tensor([1.0, -1.0]),
        "old_per_token_logps": torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]]),
        "sampling_per_token_logps": torch.tensor([[-1.5, -2.0, -0.5], [-0.2, -1.0, 0.0]]),
    }


def loss_and_grad(trainer, compute, inputs):
    """``compute(trainer.model, inputs)``'s loss and the gradient it leaves on the trainable parameters, flattened to
    float64 — how the TRL tests put the subclass's ``_compute_loss`` beside GRPOTrainer's own on one batch."""
    import torch

    params = [p for p in trainer.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loss = compute(trainer.model, dict(inputs))
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in params if p.grad is not None]).double()


def leave_head_behind(sync) -> None:
    """Make a trainer's weight push (``trainer.offpolicy_sync``) leave the tied head (``lm_head.weight``) out of every
    sync: the broken reload the sync check must stop. Every process wraps its own push the same way."""
    import offpolicy.integrations.trl.vllm_sync as vs

    push = sync.push

    def headless() -> None:
        full = vs.trl_named_weights
        vs.trl_named_weights = lambda g: ((n, t) for n, t in full(g) if n != "lm_head.weight")
        try:
            push()
        finally:
            vs.trl_named_weights = full

    sync.push = headless
