"""verl's ``PlatformBase`` on the CPU (:mod:`offpolicy_testkit.verl_cpu_bridge`, 1): a module that imports verl,
loaded by :func:`offpolicy_testkit.verl_cpu_bridge.cpu_platform` only where verl is installed."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase


class CPUDeviceModule:
    """``torch.cpu`` plus the memory and name queries verl logs (no such counters on a CPU)."""

    max_memory_allocated = max_memory_reserved = memory_allocated = memory_reserved = staticmethod(lambda *_: 0)
    mem_get_info = staticmethod(lambda *_: (0, 0))
    get_device_name = staticmethod(lambda *_: "CPU")
    get_rng_state = staticmethod(lambda *_: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, *_: torch.set_rng_state(state))
    empty_cache = staticmethod(lambda *_: None)  # verl's weight sender calls it after a sync

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


class CPUPlatform(PlatformBase):
    """verl's platform on the CPU: ``torch.cpu`` as the device module, gloo, no CUDA IPC."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = CPUDeviceModule()  # type: ignore[assignment, unused-ignore]  # torch.cpu with what verl queries (typed only where verl is installed)

    def is_available(self): return True
    def is_platform_available(self, use_smi_check=False): return True
    def current_device(self): return "cpu"
    def device_count(self): return 1
    def set_device(self, device_index): pass
    def synchronize(self, device_index=None): pass
    def manual_seed(self, seed): torch.manual_seed(seed)
    def manual_seed_all(self, seed): torch.manual_seed(seed)
    def set_allocator_settings(self, settings): pass
    def empty_cache(self): pass
    def get_device_capability(self, device_index=0): return None, None
    def communication_backend_name(self): return "gloo"
    def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
    def nvtx_range(self, msg): return contextlib.nullcontext()
    def profiler_start(self): pass
    def profiler_stop(self): pass
    def ray_resource_name(self): return "GPU"  # the job's Ray has logical GPUs that nothing touches
    def ray_noset_envvars(self): return []
    def is_ipc_supported(self): return False
    def cudart(self): return None
