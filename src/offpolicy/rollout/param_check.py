"""The parameter layer of the weight-sync check, for an engine whose tensors this process can read (an in-process
``vllm.LLM``): after a sync, every engine tensor whose trainer sources changed — as the engine stores them, cast to its
dtype — must have changed too. Exact where it applies, and blind to what the engine computes (that is the
behavioural layer's job, :mod:`offpolicy.rollout.sync_check`); it catches what the behavioural layer cannot resolve
under a small learning rate: a part of the model left behind while its drift is still below the run's noise.

Each side is compared with itself at the previous sync, never with the other: the engine stores its tensors in its
own layout (fused ``qkv_proj`` / ``gate_up_proj``, padded vocabulary rows), which the trainer cannot reproduce, but a
tensor of the engine changes exactly when one of its sources changes in the engine's dtype. A source changed by less
than the dtype's resolution leaves its cast — and the engine — unchanged: no verdict either way, no false alarm.
Fingerprints are BLAKE2b digests of each tensor's bytes (read on the host: on a GPU engine this copies every weight
once per sync). Engine tensors without storage (vLLM's CPU build repacks linear weights outside its parameters,
leaving them empty), quantised ones (fp8, int packs: not a plain cast of their sources), ones without sources among
the trainer's names, or whose sources this process holds only a shard or a placeholder of (FSDP, ZeRO-3) are not
checked, and counted
(``sync/params_checked`` of ``sync/params_total``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor


def fingerprint(tensor: Tensor) -> bytes:
    """A digest of ``tensor``'s bytes (its dtype and shape included): equal exactly when the contents are equal, up to
    a BLAKE2b collision.

    >>> fingerprint(torch.ones(3)) == fingerprint(torch.ones(3)), fingerprint(torch.ones(3)) == fingerprint(torch.zeros(3))
    (True, False)
    """
    data = tensor.detach().to("cpu").contiguous()
    digest = hashlib.blake2b(f"{data.dtype}{tuple(data.shape)}".encode(), digest_size=16)
    digest.update(data.reshape(-1).view(torch.uint8).numpy().data)
    return digest.digest()


def trainer_sources(engine_name: str, packed: Mapping[str, list[str]], trainer_names: set[str]) -> list[str] | None:
    """The trainer's names an engine tensor is built from: itself, or — for a fused module of ``packed`` (vLLM's
    ``packed_modules_mapping``, e.g. ``qkv_proj → [q_proj, k_proj, v_proj]``) — each source module's; None when one
    is not among ``trainer_names``.

    >>> names = {"l.0.q_proj.weight", "l.0.k_proj.weight", "l.0.v_proj.weight", "l.0.norm.weight"}
    >>> trainer_sources("l.0.qkv_proj.weight", {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, names)
    ['l.0.q_proj.weight', 'l.0.k_proj.weight', 'l.0.v_proj.weight']
    >>> trainer_sources("l.0.norm.weight", {}, names), trainer_sources("l.0.rotary.cache", {}, names)
    (['l.0.norm.weight'], None)
    """
    parts = engine_name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            sources = [".".join(parts[:i] + [src] + parts[i + 1:]) for src in packed[part]]
            return sources if all(s in trainer_names for s in sources) else None
    return [engine_name] if engine_name in trainer_names else None


# engine tensors stored as a plain cast of their sources; a quantised one (fp8 with a scale, int4 / int8 packs) may
# stay unchanged while the trainer's plain cast changes, so it is not judged
PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _sharded(tensor: Tensor) -> bool:
    """This process holds a shard or a placeholder of the trainer's tensor, not the tensor the engine was given: an
    FSDP2 DTensor (``device_mesh``), an FSDP1 sharded state dict's ``ShardedTensor`` (``local_shards``), a ZeRO-3
    parameter outside its gather (0 elements: its ``data`` in ``state_dict()``, DeepSpeed's
    ``runtime/zero/partition_parameters.py``; a persistent or gathered one is whole, and judged), any 0-element or
    meta tensor. Its fingerprint would never change: not judged, never counted as checked."""
    if hasattr(tensor, "device_mesh") or hasattr(tensor, "local_shards"):
        return True
    return tensor.numel() == 0 or tensor.device.type == "meta"


@dataclass
class ParameterCheck:
    """Fingerprints of the engine's tensors and of their trainer sources (cast to the engine tensor's dtype) at the
    last sync; :meth:`after_sync` names the engine tensors that stayed as they were while their sources changed.

    Args:
        packed: the engine's fused modules (``packed_modules_mapping``).
    """

    packed: Mapping[str, list[str]] = field(default_factory=dict)
    _engine: dict[str, bytes] = field(default_factory=dict, repr=False)
    _trainer: dict[str, bytes] = field(default_factory=dict, repr=False)
    total: int = 0  # engine tensors seen at the last snapshot
    checked: int = 0  # of which judged: with storage, a plain float dtype, and whole sources among the trainer's names

    def snapshot(self, engine_tensors: Iterable[tuple[str, Tensor]], trainer_state: Mapping[str, Tensor]
                 ) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """The fingerprints ``(engine, trainer)`` of every checkable engine tensor, keyed by its engine name."""
        names = set(trainer_state)
        engine, trainer, total = {}, {}, 0
        with torch.no_grad():
            for name, tensor in engine_tensors:
                total += 1
                sources = trainer_sources(name, self.packed, names)
                if (tensor.numel() == 0 or sources is None or tensor.dtype not in PLAIN_DTYPES
                        or any(_sharded(trainer_state[s]) for s in sources)):
                    continue
                engine[name] = fingerprint(tensor)
                trainer[name] = b"".join(fingerprint(trainer_state[s].to(tensor.dtype)) for s in sources)
        self.total, self.checked = total, len(engine)
        return engine, trainer

    def calibrate(self, engine_tensors: Iterable[tuple[str, Tensor]], trainer_state: Mapping[str, Tensor]) -> None:
        """Record both sides (the engine holding the trainer's weights)."""
        self._engine, self._trainer = self.snapshot(engine_tensors, trainer_state)

    def after_sync(self, engine_tensors: Iterable[tuple[str, Tensor]], trainer_state: Mapping[str, Tensor]
                   ) -> list[str]:
        """The engine tensors left behind by the sync since the last call (their sources changed, they did not);
        the record moves to this sync either way."""
        engine, trainer = self.snapshot(engine_tensors, trainer_state)
        left = [name for name in engine
                if name in self._engine and trainer[name] != self._trainer.get(name) and engine[name] == self._engine[name]]
        self._engine, self._trainer = engine, trainer
        return left
