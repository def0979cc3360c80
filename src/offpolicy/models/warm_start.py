"""Supervised warm start of the embedded models, so RL starts with a reward in (0, 1) and something to learn.

Next-token cross-entropy on ``prompt → answer<eos>`` (loss on the answer and eos only), AdamW with linear warm-up and
cosine decay. Two optional refinements make a *calibrated* starting policy for RL, used by the lab model:

* ``context_noise`` — the task's :meth:`demonstrations` write answers whose digits break the rule with this
  probability, while the target at each position is still the rule's digit given what was written. The model learns
  the rule on imperfect prefixes — the prefixes it will sample itself — instead of only on perfect ones.
* ``calibration_steps`` with ``smoothing`` = q — the last steps train on the target distribution
  (1 − q)·onehot(rule) + q·uniform(task.alphabet): the model keeps the rule as its mode but samples it with
  probability ≈ 1 − q + q/|alphabet|, so a temperature-1 rollout starts at a low reward that RL has to raise
  (the regime of LLM RL: the answer is within reach of the policy, its probability is not yet high).

A few hundred steps on two CPU cores take one to two minutes (the lab model's 200: about 110 s).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from offpolicy.rollout.base import pad_ids
from offpolicy.rollout.sampling import SamplingConfig

WARM_START_STEPS = 500
WARM_START_BATCH = 64
WARM_START_LR = 3e-3


@dataclass(frozen=True)
class WarmStartRecipe:
    """Everything that determines a warm start (hashed into the cache directory's name)."""

    steps: int = WARM_START_STEPS
    batch_size: int = WARM_START_BATCH
    lr: float = WARM_START_LR
    seed: int = 0
    context_noise: float = 0.0
    calibration_steps: int = 0
    smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1:
            raise ValueError(f"steps must be >= 0 and batch_size >= 1, got steps={self.steps}, "
                             f"batch_size={self.batch_size}")
        if not 0 <= self.calibration_steps <= self.steps:
            raise ValueError(f"calibration_steps must be in [0, steps={self.steps}], got {self.calibration_steps}")
        for name in ("context_noise", "smoothing"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")


# Threads of the warm start, fixed whatever the machine's load or core count: a matmul's float reduction order can
# depend on the thread count (seen on an AVX-512 machine: different weights with one and two threads), so a thread
# count picked from the load would make the cached model depend on how busy the machine was while it was built.
# Two threads take 0.52 s per lab-model step against 0.96 s for one on a quiet 2-core machine. The default recipes'
# weights ship with the package (offpolicy/models/data), so no machine rebuilds them: see models.cache.
WARM_START_THREADS = 2


@contextlib.contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """Run with ``n`` intra-op threads, restoring the previous setting afterwards.

    For a model of a few million parameters beside other work a second thread gains little, and on a shared 2-core
    machine oversubscribed threads spin: measured 0.12 s per step of the tiny model with one thread vs 1-4 s with two
    under load. The lab's runs and the tests therefore use one.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def encode_examples(tokenizer, prompts: list[str], answers: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids (bos + prompt) and target ids (answer + eos) for supervised training.

    >>> from offpolicy.models.tokenizer import build_tokenizer
    >>> tok = build_tokenizer()
    >>> p, a = encode_examples(tok, ["1+2="], ["3"])
    >>> tok.decode(p[0]), tok.decode(a[0])
    ('<|bos|>1+2=', '3<|eos|>')
    """
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    answer_ids = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in answers]
    return prompt_ids, answer_ids


def _demonstrations(task, n: int, seed: int, noise: float) -> list[tuple[str, str, str]]:
    """``(prompt, written, target)`` triples: the task's noisy demonstrations, or its examples (written = target)."""
    if noise > 0:
        if not hasattr(task, "demonstrations"):
            raise ValueError(f"context_noise needs a task with demonstrations(); {task.name!r} has none")
        return task.demonstrations(n, seed, noise=noise)
    return [(e.prompt, e.answer, e.answer) for e in task.examples(n, seed)]


def warm_start(model: torch.nn.Module, tokenizer, *, task=None, recipe: WarmStartRecipe | None = None,
               **overrides) -> dict[str, float]:
    """Supervised fine-tuning of ``model`` in place on ``task`` (default: arithmetic); returns
    ``{"loss": final loss, "seconds": wall time}``. ``overrides`` replace fields of ``recipe`` (``steps=15``).

    Deterministic given the recipe's seed (data from the task's examples / demonstrations; no dropout).
    """
    from offpolicy.tasks.arithmetic import ArithmeticTask

    recipe = WarmStartRecipe(**{**(recipe or WarmStartRecipe()).__dict__, **overrides})
    task = ArithmeticTask() if task is None else task
    if recipe.smoothing > 0 and not hasattr(task, "alphabet"):
        raise ValueError(f"smoothing needs a task with an alphabet; {task.name!r} has none")
    with torch_threads(WARM_START_THREADS):
        return _train(model, tokenizer, task, recipe)


def _alphabet_ids(tokenizer, alphabet: str) -> torch.Tensor:
    ids = [tokenizer(ch, add_special_tokens=False)["input_ids"] for ch in alphabet]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"task alphabet {alphabet!r}: every character must be one token")
    return torch.tensor([i[0] for i in ids])


def _train(model, tokenizer, task, recipe: WarmStartRecipe) -> dict[str, float]:
    start = time.perf_counter()
    model.train()
    steps = recipe.steps
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s, steps) / max(steps, 1))))
    )
    data = _demonstrations(task, steps * recipe.batch_size, recipe.seed, recipe.context_noise)
    alphabet = _alphabet_ids(tokenizer, task.alphabet) if recipe.smoothing > 0 else None
    pad_id = tokenizer.pad_token_id
    loss_value = float("nan")
    for step in range(steps):
        chunk = data[step * recipe.batch_size : (step + 1) * recipe.batch_size]
        prompt_ids, written_ids = encode_examples(tokenizer, [c[0] for c in chunk], [c[1] for c in chunk])
        _, target_ids = encode_examples(tokenizer, [c[0] for c in chunk], [c[2] for c in chunk])
        if any(len(w) != len(t) for w, t in zip(written_ids, target_ids)):
            raise ValueError(f"task {task.name!r}: a demonstration's written answer and target differ in tokens")
        ids, attn = pad_ids([p + w for p, w in zip(prompt_ids, written_ids)], pad_id, side="right")
        targets = torch.full_like(ids, -100)  # targets[i, j]: the token position j predicts (−100: no loss)
        for i, (p, t) in enumerate(zip(prompt_ids, target_ids)):
            targets[i, len(p) - 1 : len(p) - 1 + len(t)] = torch.tensor(t)
        logits = model(input_ids=ids, attention_mask=attn.long()).logits.float()
        logp = logits.log_softmax(-1)
        valid = targets != -100
        nll = -logp.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
        calibrating = alphabet is not None and step >= steps - recipe.calibration_steps
        if calibrating and alphabet is not None:
            # (1 − q)·onehot(rule) + q·uniform(alphabet) on answer digits; eos keeps its one-hot target
            is_answer_char = torch.isin(targets, alphabet)
            spread = -logp[..., alphabet].mean(-1)
            nll = torch.where(is_answer_char, (1 - recipe.smoothing) * nll + recipe.smoothing * spread, nll)
        loss = (nll * valid).sum() / valid.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()  # once per step: warm start is not a hot path
    model.eval()
    return {"loss": loss_value, "seconds": time.perf_counter() - start}


@torch.no_grad()
def evaluate_reward(model: torch.nn.Module, tokenizer, *, task=None, n: int = 256, seed: int = 12345,
                    cfg: SamplingConfig | None = None, dtype: str = "float32") -> dict[str, float]:
    """Mean reward and exact-answer rate of sampled completions (HF engine, temperature 1 by default).

    Returns ``{"reward": mean reward, "accuracy": fraction with reward 1.0}``.
    """
    from offpolicy.rollout.factory import build_engine
    from offpolicy.rollout.prompts import compute_rewards, step_prompts
    from offpolicy.rollout.spec import EngineSpec
    from offpolicy.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask() if task is None else task
    if cfg is None:
        length = getattr(task, "length", 7)
        cfg = SamplingConfig(max_new_tokens=length + 1)
    prompts = step_prompts(task, tokenizer, n, seed)
    engine = build_engine(EngineSpec(name="warm-start evaluation", dtype=dtype), model=model, tokenizer=tokenizer)
    out = engine.generate([p.ids for p in prompts], cfg, seed=seed)
    rewards = compute_rewards(task, prompts, 1, out.texts, out.completion_ids)
    return {"reward": float(rewards.mean()), "accuracy": float((rewards == 1.0).float().mean())}
