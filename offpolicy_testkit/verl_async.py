"""CPU only: what verl 0.9.1's asynchronous loops (``verl.experimental.one_step_off_policy.main_ppo``,
``verl.experimental.fully_async_policy.fully_async_main``) lack on a machine without an accelerator — for the
end-to-end example (examples/verl_end_to_end.py ``--loop``) and its tests, never on a GPU. A harness shipped with
the repository, not with the offpolicy package.

Those loops keep the trainer and the rollout apart (``actor_rollout_ref.hybrid_engine=false``: the actor's FSDP
workers in one resource pool, vLLM's servers in their own) and move the weights with a *checkpoint engine*; the
loops' configs name ``nccl`` (``NCCLCheckpointEngine``: cupy buffers and a Ray NCCL collective group between actor
rank 0 and every rollout worker), which does not import without CUDA. verl's own hook for another transport is
``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module`` (imported by the actor workers and by the
rollout's ``CheckpointEngineWorker`` before the backend is built): naming this module there and
``checkpoint_engine.backend=offpolicy_cpu`` gives :class:`CPUCheckpointEngine` — the full tensors over a zmq
request/reply socket from actor rank 0 to each rollout worker, into verl's own ``ServerAdapter.update_weights``
(the same vLLM path as the synchronous loop's push, which :mod:`offpolicy_testkit.verl_cpu_bridge` bridges).
Importing the module registers the backend. Named in the job's ``VERL_USE_EXTERNAL_MODULES`` too (after the CPU
bridge), it also bridges one call in the vLLM server's process: verl's ``abort_all_requests`` (run before every
sync of the separated loops, to abort and later resume partial rollouts) calls
``AsyncLLM.pause_generation(wait_for_inflight_requests=False, clear_cache=…)``, the keyword of the vLLM verl 0.9.1
was written against; vLLM's CPU build 0.32 spells it ``mode="abort"`` (``"wait"`` for True).
:func:`pause_generation_compat` translates the keyword, only where the installed signature lacks it, and
:func:`offpolicy_testkit.verl_cpu_bridge.uninstall` restores it.

:func:`loop_overrides` is the config a loop needs on top of the synchronous example's.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch

logger = logging.getLogger(__name__)

BACKEND = "offpolicy_cpu"
LOOPS = {  # the example's --loop: verl's entry module of each loop
    "main_ppo": "verl.trainer.main_ppo",
    "one_step_off_policy": "verl.experimental.one_step_off_policy.main_ppo",
    "fully_async": "verl.experimental.fully_async_policy.fully_async_main",
}
TIMEOUT_MS = 600_000  # a push that nobody collects fails the sync instead of hanging the run


def serialize(weights: list[tuple[str, torch.Tensor]]) -> bytes:
    """The named tensors as one ``torch.save`` payload."""
    buffer = io.BytesIO()
    torch.save(weights, buffer)
    return buffer.getvalue()


def deserialize(payload: bytes) -> list[tuple[str, torch.Tensor]]:
    return torch.load(io.BytesIO(payload), weights_only=True)


def _engine_base() -> type:
    try:
        from verl.checkpoint_engine.base import CheckpointEngine
    except ImportError:  # verl absent: the helpers above still import (unit tests)
        return object
    return CheckpointEngine


class CPUCheckpointEngine(_engine_base()):  # type: ignore[misc]
    """verl's ``CheckpointEngine`` on a CPU: actor rank 0 (``is_master``) binds a zmq REP socket in
    :meth:`prepare`, walks the weight generator in :meth:`send_weights` (every actor rank walks it: producing each
    full tensor is an FSDP all-gather) and answers each of the ``receivers`` rollout workers' one request with the
    whole payload; a rollout worker's :meth:`receive_weights` asks once and yields the named tensors. verl rebuilds
    the topology on every sync (``prepare`` → ``build_topology`` → ``init_process_group`` → send / receive →
    ``finalize``), so each sync has its own socket."""

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **_: Any) -> None:
        self.bucket_size, self.is_master = bucket_size, is_master
        self.socket: Any = None
        self.address: str | None = None
        self.rank, self.receivers = -1, 0

    def prepare(self) -> dict[str, Any]:
        if self.is_master:
            import zmq

            self.socket = zmq.Context.instance().socket(zmq.REP)
            self.socket.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
            self.socket.setsockopt(zmq.SNDTIMEO, TIMEOUT_MS)
            port = self.socket.bind_to_random_port("tcp://127.0.0.1")
            self.address = f"tcp://127.0.0.1:{port}"
        return {"address": self.address}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        address = metadata[0]["address"]
        if address is None:
            raise RuntimeError("offpolicy_cpu checkpoint engine: actor rank 0 is not the master (no address)")
        actor = {"rank": list(range(actor_wg_world_size)), "address": [address] * actor_wg_world_size,
                 "receivers": [rollout_world_size] * actor_wg_world_size}
        rollout = {"rank": list(range(actor_wg_world_size, actor_wg_world_size + rollout_world_size)),
                   "address": [address] * rollout_world_size, "receivers": [rollout_world_size] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, address: str, receivers: int) -> None:
        self.rank, self.address, self.receivers = rank, address, receivers

    def finalize(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
        self.socket = None

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict:
        start = time.perf_counter()
        named = [(name, tensor.detach().to("cpu").clone()) for name, tensor in _iterate(weights)]
        if not self.is_master:
            return {}
        payload = serialize(named)
        for _ in range(self.receivers):  # one request per rollout worker, each answered with the whole payload
            self.socket.recv()
            self.socket.send(payload)
        logger.info("offpolicy_cpu checkpoint engine: %d tensors (%d bytes) to %d rollout worker(s) in %.2f s",
                    len(named), len(payload), self.receivers, time.perf_counter() - start)
        return {}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        import zmq

        socket = zmq.Context.instance().socket(zmq.REQ)
        socket.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        socket.setsockopt(zmq.SNDTIMEO, TIMEOUT_MS)
        socket.connect(self.address)
        try:
            socket.send(b"ready")
            named = deserialize(socket.recv())
        finally:
            socket.close(linger=0)
        for name, tensor in named:
            yield name, tensor


def _iterate(weights: Any) -> list[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        raise TypeError("offpolicy_cpu checkpoint engine: an async weight generator is not supported")
    return list(weights)


PAUSE_MODULE = "vllm.v1.engine.async_llm"


def pause_generation_compat(original: Any) -> Any:
    """``AsyncLLM.pause_generation`` taking verl's ``wait_for_inflight_requests`` (False → ``mode="abort"``, True →
    ``mode="wait"``) where the installed vLLM takes ``mode`` only (module docstring)."""

    async def pause_generation(self: Any, *, wait_for_inflight_requests: bool | None = None, mode: str | None = None,
                               clear_cache: bool = True, **kwargs: Any) -> Any:
        if mode is None:
            mode = "wait" if wait_for_inflight_requests else "abort"
        return await original(self, mode=mode, clear_cache=clear_cache, **kwargs)

    pause_generation.__wrapped__ = original  # type: ignore[attr-defined]
    return pause_generation


def _bridge_pause(module: Any) -> None:
    import inspect

    from offpolicy_testkit import verl_cpu_bridge

    method = module.AsyncLLM.pause_generation
    if "wait_for_inflight_requests" in inspect.signature(method).parameters or hasattr(method, "__wrapped__"):
        return  # the vLLM verl was written against, or bridged already
    verl_cpu_bridge._patch(module.AsyncLLM, "pause_generation", pause_generation_compat(method))


def install() -> str:
    """In this process: the pause bridge once vLLM's ``AsyncLLM`` module loads, where the CPU bridge applies."""
    from offpolicy_testkit import verl_cpu_bridge

    why_not = verl_cpu_bridge.applies()
    if why_not is not None:
        return f"skipped: {why_not}"
    verl_cpu_bridge._after_import(PAUSE_MODULE, _bridge_pause)
    return "pause_generation(wait_for_inflight_requests=) bridged"


def register() -> str:
    """Register :class:`CPUCheckpointEngine` as ``offpolicy_cpu`` in verl's registry (idempotent)."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    CheckpointEngineRegistry.register(BACKEND)(CPUCheckpointEngine)
    return BACKEND


def loop_overrides(loop: str, ranks: int = 1, steps: int = 2, prompts: int = 2) -> list[str]:
    """verl's config for ``loop`` beyond the synchronous example's (a key given here replaces the example's): nothing
    for ``main_ppo``; for the separated loops a rollout pool of its own (one logical GPU: one vLLM server), the
    hybrid engine off, the weights over :class:`CPUCheckpointEngine`, and the decoupled mode (``bypass_mode=false``:
    the loops' configs default to bypass, where π_old *is* the rollout's μ and a correction has nothing to correct).
    ``fully_async`` also: the rollouter's stream of single prompts (``gen_batch_size=1``, ``train_batch_size=0``),
    ``steps × prompts`` of them, a weight sync after every step (``trigger_parameter_sync_step=1``), samples up to
    one version stale in the queue (``staleness_threshold=1``) and partial rollouts (an aborted trajectory resumes
    under the new weights: its ``min_global_steps`` < ``max_global_steps``), and Ray's logical CPUs raised to
    32 for verl's actors' requests. ``ranks`` > 1 is refused there: one
    rollout replica is what these runs afford on a shared CPU."""
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {tuple(LOOPS)}, got {loop!r}")
    if loop == "main_ppo":
        return []
    if ranks != 1:
        raise ValueError(f"ranks must be 1 in the {loop} loop on a CPU, got {ranks}")
    out = ["actor_rollout_ref.hybrid_engine=false",
           "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
           f"actor_rollout_ref.rollout.checkpoint_engine.backend={BACKEND}",
           f"actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module={__name__}",
           "algorithm.rollout_correction.bypass_mode=false"]
    if loop == "fully_async":
        # Ray's logical CPUs: the runner, the trainer and the rollouter actors ask for 1 + 10 + 10, the message
        # queue for 2 (nothing pins them); the example's 16 would leave the rollouter pending forever
        out += ["ray_kwargs.ray_init.num_cpus=32", "data.train_batch_size=0", "data.gen_batch_size=1", f"rollout.total_rollout_steps={steps * prompts}",
                "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=1",
                "async_training.partial_rollout=true", "async_training.require_batches=1"]
    return out


def merged(base: list[str], extra: list[str]) -> list[str]:
    """Hydra overrides ``base`` with each key of ``extra`` replacing ``base``'s (or appended)."""
    keys = {item.split("=", 1)[0].lstrip("+") for item in extra}
    return [item for item in base if item.split("=", 1)[0].lstrip("+") not in keys] + list(extra)


try:  # verl imports this module by name (custom_backend_module) before it builds the backend
    register()
except ImportError:  # verl absent: the helpers still import
    pass
# the pause bridge where verl imports this module in every process (VERL_USE_EXTERNAL_MODULES), not where a test
# merely imports it
STATUS = install() if __name__ in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") else "not installed"
