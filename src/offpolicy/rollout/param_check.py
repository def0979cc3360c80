"""The parameter layer of the weight-sync check, for an engine whose tensors this process can read (an in-process
``vllm.LLM``): after a sync, every engine tensor whose trainer sources changed — as the engine stores them, cast to its
dtype — must have changed too. Exact where it applies, and blind to what the engine computes (that is the
behavioural layer's job, :mod:`offpolicy.rollout.sync_check`); it catches what the behavioural layer cannot resolve
under a small learning rate: a part of the model left behind while its drift is still below the run's noise.

Each side is compared with itself at the previous sync, never with the other: the engine stores its tensors in its
own layout (fused ``qkv_proj`` / ``gate_up_proj``, padded vocabulary rows, a mixture-of-experts layer's experts
stacked into two tensors: :func:`trainer_sources`), which the trainer cannot reproduce, but a tensor of the engine
changes exactly when one of its sources changes in the engine's dtype. A source changed by less than the dtype's
resolution leaves its cast — and the engine — unchanged: no verdict either way, no false alarm.
Fingerprints are taken where each tensor lives (``mode="device"``, the default): on an accelerator a digest computed
there (:func:`device_digest`: exact integer arithmetic, no host copy, 16 bytes back per tensor), on the host a BLAKE2b
digest of its bytes (:func:`fingerprint`; on a CPU the faster of the two). ``mode="hash"`` hashes every tensor with
BLAKE2b on the host, copying an accelerator's tensors there — about two model sizes per sync, which at 7 B costs more
than the sync itself (docs/benchmarks.md). Engine tensors without storage (vLLM's CPU build repacks linear weights outside its parameters,
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


# the device digest: K universal hashes modulo the Mersenne prime P of the tensor's 16-bit words, in blocks of BLOCK
# words. Each word w < 2¹⁶ times a coefficient r < P < 2³¹ is below 2⁴⁷, so a block's sum of 2¹⁶ such products stays
# below 2⁶³: exact in int64 on any device, in any summation order, hence the same digest on a CPU and a GPU
DIGEST_P = 2**31 - 1
DIGEST_K = 2
BLOCK = 1 << 16
CHUNK = 1 << 22  # words per pass: 32 MiB of int64 temporaries on the tensor's device, whatever its size
DIGEST_SEED = 20_260_101
_coefficients: dict[tuple[str, int], Tensor] = {}


def _coefficient(device: torch.device, segment: int) -> Tensor:
    """The fixed random coefficients ``[K, BLOCK]`` in [1, P) of segment ``segment`` (0: the words within a block;
    1, 2, …: the blocks, BLOCK at a time), generated on the CPU from a fixed seed and cached on ``device``."""
    key = (str(device), segment)
    if key not in _coefficients:
        gen = torch.Generator().manual_seed(DIGEST_SEED + segment)
        _coefficients[key] = torch.randint(1, DIGEST_P, (DIGEST_K, BLOCK), generator=gen).to(device)
    return _coefficients[key]


def device_digest(tensor: Tensor, dtype: torch.dtype | None = None) -> bytes:
    """A digest of ``tensor.to(dtype)``'s bytes (dtype and shape included) computed on ``tensor``'s device, CHUNK
    words at a time (the cast too: no full-size copy), 16 bytes brought back. With w_{b,j} the j-th 16-bit word of
    block b and r, s fixed random coefficients in [1, P), each of the K hashes is
    h = Σ_b s_b · (Σ_j r_j w_{b,j} mod P) mod P. Two different contents of one dtype and shape collide with
    probability at most (2 / (P − 1))^K ≈ 8.7e-19 over the coefficients (a universal hash per level; the weights do
    not depend on the seed), and never when they differ in one word (r_j, s_b ≠ 0 mod P).

    >>> x = torch.randn(100_000, dtype=torch.bfloat16)
    >>> y = x.clone(); y.view(torch.int16)[70_000] ^= 1
    >>> device_digest(x) == device_digest(x.clone()), device_digest(x) == device_digest(y)
    (True, False)
    >>> device_digest(x.float(), torch.bfloat16) == device_digest(x)  # the cast is taken chunk by chunk
    True
    """
    dtype = tensor.dtype if dtype is None else dtype
    if torch.empty(0, dtype=dtype).element_size() < 2:
        raise ValueError(f"device_digest: dtype {dtype} has elements of one byte; it digests 16-bit words")
    flat = tensor.detach().reshape(-1)
    per_word = torch.empty(0, dtype=dtype).element_size() // 2
    step = CHUNK // per_word  # elements per pass; a multiple of BLOCK words
    rows = _coefficient(flat.device, 0)
    hashes = [0] * DIGEST_K
    for start in range(0, flat.numel(), step):
        words = flat[start:start + step].to(dtype).contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
        n = words.numel()
        blocks = -(-n // BLOCK)
        words = torch.nn.functional.pad(words, (0, blocks * BLOCK - n)).view(blocks, BLOCK)
        first = start * per_word // BLOCK  # this chunk's first block
        segment, offset = divmod(first, BLOCK)  # CHUNK divides BLOCK²: a chunk's blocks lie in one segment
        outer = _coefficient(flat.device, 1 + segment)[:, offset:offset + blocks]
        for k in range(DIGEST_K):
            inner = (words * rows[k]).sum(-1) % DIGEST_P
            hashes[k] = (hashes[k] + int(((inner * outer[k]) % DIGEST_P).sum())) % DIGEST_P
    head = f"{dtype}{tuple(tensor.shape)}".encode()
    return head + b"".join(h.to_bytes(4, "little") for h in hashes)


# vLLM's fused experts (``FusedMoE``) store each MoE layer's experts as two stacked tensors, ``w13_weight``
# ``[E, 2I, H]`` (every expert's gate and up projections) and ``w2_weight`` ``[E, H, I]`` (its down projection), under
# ``<layer>.experts.`` (``<layer>.experts.routed_experts.`` in vLLM 0.32). Their trainer sources, in the layouts a
# transformers model holds: the stacked experts of transformers ≥ 5 (``experts.gate_up_proj`` / ``experts.down_proj``,
# Qwen2/3-MoE, Mixtral, OLMoE), or one module per expert (``experts.<e>.gate_proj`` + ``up_proj`` / ``down_proj``;
# Mixtral's ``w1`` + ``w3`` / ``w2``).
EXPERT_TENSORS = {"w13_weight": ("gate_up_proj", (("gate_proj", "up_proj"), ("w1", "w3"))),
                  "w2_weight": ("down_proj", (("down_proj",), ("w2",)))}
EXPERT_INFIXES = ("routed_experts",)  # wrappers vLLM puts between ``experts`` and the stacked tensor


def expert_sources(engine_name: str, trainer_names: set[str]) -> list[str] | None:
    """The trainer's names a vLLM fused-experts tensor (``…experts[.routed_experts].w13_weight`` / ``w2_weight``) is
    built from: the stacked tensor of transformers ≥ 5, else every expert's modules in expert order (as many as
    the trainer has, from expert 0); None for another name or when the trainer holds neither layout.

    >>> names = {"l.0.mlp.experts.gate_up_proj", "l.0.mlp.experts.down_proj"}
    >>> expert_sources("l.0.mlp.experts.routed_experts.w13_weight", names)
    ['l.0.mlp.experts.gate_up_proj']
    >>> per_expert = {f"l.0.mlp.experts.{e}.{m}.weight" for e in range(2) for m in ("w1", "w2", "w3")}
    >>> expert_sources("l.0.mlp.experts.w13_weight", per_expert)
    ['l.0.mlp.experts.0.w1.weight', 'l.0.mlp.experts.0.w3.weight', 'l.0.mlp.experts.1.w1.weight', 'l.0.mlp.experts.1.w3.weight']
    >>> expert_sources("l.0.mlp.experts.w2_weight", names - {"l.0.mlp.experts.down_proj"}) is None
    True
    """
    head, _, leaf = engine_name.rpartition(".")
    if leaf not in EXPERT_TENSORS:
        return None
    for infix in EXPERT_INFIXES:
        head = head.removesuffix(f".{infix}")
    if not head.endswith("experts"):
        return None
    stacked, per_expert = EXPERT_TENSORS[leaf]
    if f"{head}.{stacked}" in trainer_names:
        return [f"{head}.{stacked}"]
    for modules in per_expert:
        sources: list[str] = []
        while all(f"{head}.{len(sources) // len(modules)}.{m}.weight" in trainer_names for m in modules):
            e = len(sources) // len(modules)
            sources += [f"{head}.{e}.{m}.weight" for m in modules]
        if sources:
            return sources
    return None


def trainer_sources(engine_name: str, packed: Mapping[str, list[str]], trainer_names: set[str]) -> list[str] | None:
    """The trainer's names an engine tensor is built from: itself, or — for a fused module of ``packed`` (vLLM's
    ``packed_modules_mapping``, e.g. ``qkv_proj → [q_proj, k_proj, v_proj]``) — each source module's, or — for vLLM's
    fused experts of a mixture-of-experts layer — the experts' (:func:`expert_sources`); None when one is not among
    ``trainer_names``.

    >>> names = {"l.0.q_proj.weight", "l.0.k_proj.weight", "l.0.v_proj.weight", "l.0.norm.weight"}
    >>> trainer_sources("l.0.qkv_proj.weight", {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, names)
    ['l.0.q_proj.weight', 'l.0.k_proj.weight', 'l.0.v_proj.weight']
    >>> trainer_sources("l.0.norm.weight", {}, names), trainer_sources("l.0.rotary.cache", {}, names)
    (['l.0.norm.weight'], None)
    """
    experts = expert_sources(engine_name, trainer_names)
    if experts is not None:
        return experts
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


PARAMETER_MODES = ("device", "hash")


@dataclass
class ParameterCheck:
    """Fingerprints of the engine's tensors and of their trainer sources (cast to the engine tensor's dtype) at the
    last sync; :meth:`after_sync` names the engine tensors that stayed as they were while their sources changed.

    Args:
        packed: the engine's fused modules (``packed_modules_mapping``).
        mode: ``"device"`` — each tensor fingerprinted where it lives (:func:`device_digest` off the host, BLAKE2b
            on it); ``"hash"`` — BLAKE2b of every tensor on the host, copied there.
        host_types: the device types whose tensors ``"device"`` hashes with BLAKE2b (already on the host).
    """

    packed: Mapping[str, list[str]] = field(default_factory=dict)
    mode: str = "device"
    host_types: tuple[str, ...] = ("cpu",)
    _engine: dict[str, bytes] = field(default_factory=dict, repr=False)
    _trainer: dict[str, bytes] = field(default_factory=dict, repr=False)
    total: int = 0  # engine tensors seen at the last snapshot
    checked: int = 0  # of which judged: with storage, a plain float dtype, and whole sources among the trainer's names
    # bytes the last snapshot read, both sides: through BLAKE2b on the host, copied there from a device to be hashed,
    # and read where they live by device_digest (each source in its own dtype)
    bytes_hashed: int = 0
    bytes_copied: int = 0
    bytes_digested: int = 0

    def __post_init__(self) -> None:
        if self.mode not in PARAMETER_MODES:
            raise ValueError(f"mode must be one of {PARAMETER_MODES}, got {self.mode!r}")

    def _fingerprint(self, tensor: Tensor, dtype: torch.dtype) -> bytes:
        """``tensor`` cast to ``dtype``, fingerprinted as :attr:`mode` says; counts the bytes read."""
        if self.mode == "device" and tensor.device.type not in self.host_types:
            self.bytes_digested += tensor.numel() * tensor.element_size()
            return device_digest(tensor, dtype)
        cast = tensor.to(dtype)
        size = cast.numel() * cast.element_size()
        self.bytes_hashed += size
        self.bytes_copied += size if cast.device.type != "cpu" else 0
        return fingerprint(cast)

    def snapshot(self, engine_tensors: Iterable[tuple[str, Tensor]], trainer_state: Mapping[str, Tensor]
                 ) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """The fingerprints ``(engine, trainer)`` of every checkable engine tensor, keyed by its engine name."""
        names = set(trainer_state)
        engine, trainer, total = {}, {}, 0
        self.bytes_hashed = self.bytes_copied = self.bytes_digested = 0
        with torch.no_grad():
            for name, tensor in engine_tensors:
                total += 1
                sources = trainer_sources(name, self.packed, names)
                if (tensor.numel() == 0 or sources is None or tensor.dtype not in PLAIN_DTYPES
                        or any(_sharded(trainer_state[s]) for s in sources)):
                    continue
                if (expert_sources(name, names) is not None
                        and sum(trainer_state[s].numel() for s in sources) != tensor.numel()):
                    continue  # the engine holds a share of the experts (expert parallelism): not the same tensors
                engine[name] = self._fingerprint(tensor, tensor.dtype)
                trainer[name] = b"".join(self._fingerprint(trainer_state[s], tensor.dtype) for s in sources)
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
