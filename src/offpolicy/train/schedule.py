"""Learning-rate schedules: the learning rate of each step as a pure function of the step, so a resumed run needs no
scheduler state and reproduces the uninterrupted one.

With base rate η, step s (0-based) of S, floor m = ``min_lr_scale`` and W warm-up steps:

* ``constant`` — η;
* ``cosine``   — η · (m + (1 − m) · ½ (1 + cos(π s / S)));
* ``step``     — η · max(m, f^⌊s / k⌋) with f = ``step_factor``, k = ``step_every`` (a fixed version of the LR guard's
  halving, :class:`~offpolicy.train.controllers.LRGuard`);

and for s < W each is multiplied by the linear warm-up (s + 1) / W. The rate is never 0: the cosine reaches η·m
only after the last step, and the config requires m > 0 for ``step``.
"""

from __future__ import annotations

import math
from typing import Any

SCHEDULES = ("constant", "cosine", "step")


def lr_at(optim: Any, step: int, total_steps: int) -> float:
    """The learning rate of 0-based ``step`` of ``total_steps`` under ``optim`` (a ``TrainConfig.optim``).

    >>> from types import SimpleNamespace as NS
    >>> opt = NS(lr=1e-3, schedule="step", step_every=10, step_factor=0.5, min_lr_scale=0.2, warmup_steps=0)
    >>> [lr_at(opt, s, 100) for s in (0, 9, 10, 25, 99)]     # 1e-3, 1e-3, ½, ¼, floor 0.2
    [0.001, 0.001, 0.0005, 0.00025, 0.0002]
    >>> opt = NS(lr=1e-3, schedule="cosine", min_lr_scale=0.0, warmup_steps=2)
    >>> [round(lr_at(opt, s, 4), 6) for s in range(4)]     # warm-up ½, 1 × cos terms 1, 0.854, 0.5, 0.146
    [0.0005, 0.000854, 0.0005, 0.000146]
    """
    if optim.schedule == "constant":
        scale = 1.0
    elif optim.schedule == "cosine":
        m = optim.min_lr_scale
        scale = m + (1 - m) * 0.5 * (1 + math.cos(math.pi * step / total_steps))
    elif optim.schedule == "step":
        scale = max(optim.min_lr_scale, optim.step_factor ** (step // optim.step_every))
    else:
        raise ValueError(f"optim.schedule must be one of {SCHEDULES}, got {optim.schedule!r}")
    if step < optim.warmup_steps:
        scale *= (step + 1) / optim.warmup_steps
    return optim.lr * scale


def is_scheduled(optim: Any) -> bool:
    """Whether the rate changes with the step (otherwise the trainer leaves the optimiser's rate alone)."""
    return optim.schedule != "constant" or optim.warmup_steps > 0
