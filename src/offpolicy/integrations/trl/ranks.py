"""How many processes a TRL run has, as torch.distributed sees it — the one test behind every "several processes?"
branch of the integration (the sigma all-reduce of ALP, the sync check's verdict, the weight-push choice)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def world_size(group: Any = None) -> int:
    """The number of processes in ``group`` (the default group); 1 when torch.distributed is not initialised.

    >>> world_size()        # a plain process
    1
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)
