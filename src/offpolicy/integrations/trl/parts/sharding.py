"""The output head and σ's gradient under a sharded trainer (DeepSpeed ZeRO-3, FSDP1, FSDP2).

Sampling replay, DVP, top-k TRM and score centering recompute the head as h·Wᵀ + b outside the model's forward
(:mod:`offpolicy.integrations.trl.parts.scoring`), so they read ``lm_head.weight`` (tied to the embedding in many
models) directly. Each sharding leaves it in another state there:

* FSDP2: a ``DTensor`` shard (or, between the root's forward and backward, the gathered parameter).
  :func:`gathered_head` all-gathers it with ``full_tensor`` whose backward reduce-scatters the head's gradient with
  the average FSDP2 applies to the model's own gradients — the default ``full_tensor()`` would hand each rank its
  own rank's gradient for its shard, unreduced (the per-token values right, the update silently wrong).
* ZeRO-3: a 0-element placeholder (``ds_id``, ``ds_status``, ``ds_shape``, ``ds_tensor``: DeepSpeed's
  ``runtime/zero/partition_parameters.py``). ``deepspeed.zero.GatheredParameters`` restores it only inside its
  context, and the π_θ forward's backward reads the head after that context has closed: refused.
* FSDP1: a flat shard's 1-D view (``use_orig_params=True``) or a view of freed storage; ``summon_full_params``
  gives no gradient: refused.

:func:`refuse_sharded_head` refuses those options at construction, one line naming the option and the sharding;
:func:`gathered_head` refuses again at the forward for a model sharded after construction. ALP reads no weight (its
``layers='logits'`` is refused anyway), but σ lives outside the model: :func:`training_groups` finds the process
groups the model's gradients are averaged over, for σ's all-reduce (:mod:`offpolicy.integrations.trl.alp`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

SHARDINGS = ("zero3", "fsdp1", "fsdp2")
# how each refused sharding leaves the head, for the refusal's message
_WHY = {"zero3": "ZeRO-3 shards (a 0-size placeholder outside its forward); not supported under ZeRO-3 yet "
                 "(use ZeRO-2)",
        "fsdp1": "FSDP1 shards (summon_full_params gives it no gradient); not supported under FSDP1 yet "
                 "(use FSDP2: fsdp_version 2)"}


def _zero3_param(p: Tensor) -> bool:
    return hasattr(p, "ds_id") and hasattr(p, "ds_tensor")


def _is_fsdp1(module: Any) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch without distributed
        return False
    return isinstance(module, FullyShardedDataParallel)


def model_sharding(model: Any, accelerator: Any = None) -> str | None:
    """``"zero3"``, ``"fsdp1"``, ``"fsdp2"`` or None: how the trainer shards ``model`` — from accelerate's plan
    (``deepspeed_plugin.zero_stage``, ``fsdp_plugin.fsdp_version``: the HF Trainer wraps the model only in
    ``train()``) or from the model itself (ZeRO-3 placeholders, an FSDP1 wrapper, DTensor parameters).

    >>> model_sharding(torch.nn.Linear(2, 2))   # a plain module, no accelerator
    """
    state = getattr(accelerator, "state", None)
    ds = getattr(state, "deepspeed_plugin", None)
    if ds is not None and getattr(ds, "zero_stage", None) == 3:
        return "zero3"
    fsdp = getattr(state, "fsdp_plugin", None)
    if fsdp is not None:
        return "fsdp2" if getattr(fsdp, "fsdp_version", 1) == 2 else "fsdp1"
    if model is None or not hasattr(model, "modules"):
        return None
    if any(_is_fsdp1(m) for m in model.modules()):
        return "fsdp1"
    for p in model.parameters():
        if _zero3_param(p):
            return "zero3"
        if hasattr(p, "device_mesh"):
            return "fsdp2"
    return None


def refuse_sharded_head(options: Iterable[str], sharding: str | None) -> None:
    """Raise ``ValueError`` naming the first option of ``options`` (``"sampling_replay=True"``…) that reads the
    output head, when ``sharding`` leaves it unreadable there (ZeRO-3, FSDP1; FSDP2 is gathered).

    >>> refuse_sharded_head(["sampling_replay=True"], "fsdp2")   # gathered: allowed
    >>> refuse_sharded_head(["topk_logprobs=4"], "zero3")
    Traceback (most recent call last):
    ...
    ValueError: topk_logprobs=4 reads the output head, which ZeRO-3 shards (a 0-size placeholder outside its forward); not supported under ZeRO-3 yet (use ZeRO-2)
    """
    first = next(iter(options), None)
    if first is not None and sharding in _WHY:
        raise ValueError(f"{first} reads the output head, which {_WHY[sharding]}")


def head_options(*, sampling_replay: bool = False, dvp_rho: float | None = None, topk_logprobs: int = 0,
                 score_centering: bool = False) -> list[str]:
    """The options set among those that read the output head, as the user wrote them (for the refusal).

    >>> head_options(dvp_rho=0.05, topk_logprobs=4)
    ['dvp_rho=0.05', 'topk_logprobs=4']
    """
    named = {"sampling_replay": sampling_replay or None, "dvp_rho": dvp_rho, "topk_logprobs": topk_logprobs or None,
             "score_centering": score_centering or None}
    return [f"{k}={v!r}" for k, v in named.items() if v is not None]


def _gathered(t: Tensor) -> Tensor:
    from torch.distributed.tensor import Partial

    # the gathered head's gradient: averaged over the mesh and scattered back to the shards, as FSDP2 reduces the
    # model's own gradients (the default, Replicate, would keep each rank's own contribution to its shard)
    return t.full_tensor(grad_placements=[Partial("avg")] * t.device_mesh.ndim)  # type: ignore[attr-defined]


def gathered_head(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The whole head ``weight`` [V, H] and ``bias`` [V]: an FSDP2 DTensor all-gathered (differentiable, its gradient
    averaged back onto the shards); a ZeRO-3 placeholder or an FSDP1 flat shard raises ``ValueError`` naming it."""
    if _zero3_param(weight) and weight.numel() == 0:
        raise ValueError("lm_head.weight is a ZeRO-3 placeholder (0 elements): sampling replay / DVP / top-k TRM "
                         "read the output head, which ZeRO-3 shards; not supported under ZeRO-3 yet (use ZeRO-2)")
    if hasattr(weight, "full_tensor"):
        weight = _gathered(weight)
        bias = _gathered(bias) if bias is not None and hasattr(bias, "full_tensor") else bias
    if weight.dim() != 2 or weight.numel() == 0:
        raise ValueError(f"lm_head.weight has shape {tuple(weight.shape)} here, not [V, H] (an FSDP1 flat shard?): "
                         "sampling replay / DVP / top-k TRM read the output head whole; not supported under FSDP1 "
                         "yet (use FSDP2: fsdp_version 2)")
    return weight, bias


def training_groups(model: Any) -> list[Any]:
    """The process groups ``model``'s gradients are averaged over, for a tensor outside it (ALP's σ): an FSDP2
    parameter's mesh, one group per dimension (HSDP: replicate × shard; averaging over each in turn averages over
    all); an FSDP1 or DDP wrapper's ``process_group`` (HYBRID_SHARD's inter-node group too); a DeepSpeed engine's
    data-parallel group; else ``[None]``, the default group.

    >>> training_groups(torch.nn.Linear(2, 2))
    [None]
    """
    ds_group = getattr(model, "data_parallel_group", None)  # DeepSpeedEngine
    if ds_group is not None:
        return [ds_group]
    group = getattr(model, "process_group", None)  # FSDP1, DDP
    if group is not None and (_is_fsdp1(model) or isinstance(model, torch.nn.parallel.DistributedDataParallel)):
        inter = getattr(model, "_inter_node_pg", None)
        return [group] if inter is None else [group, inter]
    if hasattr(model, "parameters"):
        for p in model.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                return [mesh.get_group(d) for d in range(mesh.ndim)]
    return [None]
