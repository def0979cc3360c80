"""Named lab settings: the trainer overrides every run of a sweep shares, and the sweep's default plan.

A setting is one plain dict: ``overrides`` (trainer ``key=value``, as on the ``offpolicy train`` command line),
``presets``, ``mismatches`` (names of :mod:`offpolicy.lab.mismatch`; the ``none`` control is always added),
``seeds`` (how many: seeds 0 … n−1), ``steps``. The command line overrides each part
(``offpolicy lab --setting quick --presets naive,mis --steps 30 optim.lr=1e-4``).

>>> get_setting("quick")["steps"]
60
>>> get_setting("fast")
Traceback (most recent call last):
...
ValueError: --setting 'fast' is unknown; choose one of ['quick', 'full']
"""

from __future__ import annotations

import copy
from typing import Any

# What every lab run shares: the 5 M-parameter embedded model on the pattern task with 32-token answers.
LAB_BASE = [
    "model.path=lab",
    "task.name=pattern",
    "task.options={length: 32}",
    "task.prompts_per_step=8",
    "algorithm.group_size=8",
    "rollout.sampling.max_new_tokens=32",
    "optim.lr=2e-5",
    "optim.minibatches=2",
    "run.threads=1",  # one torch thread per run: the sweep runs one process per core
    "run.tensorboard=false",
    "run.progress=false",
    "run.checkpoint_every=25",
]

SETTINGS: dict[str, dict[str, Any]] = {
    # the demo: naive against the corrections that should hold, on the control and one harsh mismatch
    "quick": {
        "description": "the demo: naive vs MIS / TRM / DVP+MIS, fp32 control vs int8 weights + 4-bit KV cache",
        "overrides": [*LAB_BASE],
        "presets": ["naive", "mis", "trm", "dvp_mis"],
        "mismatches": ["none", "int8+kv4"],
        "seeds": 3,
        "steps": 60,
    },
    # the lab table: every family of correction against each real engine mismatch source
    "full": {
        "description": "every correction family on each engine mismatch source",
        "overrides": [*LAB_BASE],
        "presets": ["naive", "tis", "mis", "icepop", "trm", "dvp_mis", "alp"],
        "mismatches": ["none", "bf16", "int8", "kv4", "int8+kv4"],
        "seeds": 3,
        "steps": 200,
    },
}


def get_setting(name: str) -> dict[str, Any]:
    """A copy of the named setting (safe to modify). Raises ``ValueError`` naming ``--setting`` when unknown."""
    if name not in SETTINGS:
        raise ValueError(f"--setting {name!r} is unknown; choose one of {list(SETTINGS)}")
    return copy.deepcopy(SETTINGS[name])
