"""The vLLM engine TRL builds, as offpolicy needs it: extra ``vllm.LLM`` arguments for the colocated engine, the
server's log-prob mode checked, and the weight sync through ``reload_weights`` / files, checked after every sync
(:mod:`offpolicy.integrations.trl.vllm_sync`).

Settings: ``vllm_kwargs``, ``vllm_server_sync``, ``vllm_weights_dir``, ``vllm_request_timeout``, ``sync_check``.
Metrics: ``sync/…``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from offpolicy.integrations.trl.parts import TRLBase
from offpolicy.integrations.trl.patches import request_timeouts
from offpolicy.integrations.trl.ranks import world_size
from offpolicy.integrations.trl.vllm_sync import FileSync, TRLSyncCheck, install_vllm_sync, uses_files, vllm_on_cpu
from offpolicy.rollout.sync_check import SyncCheck


def _colocate_llm_kwargs(cfg: Any, given: dict[str, Any] | None, topk: int) -> dict[str, Any]:
    """Extra ``vllm.LLM`` arguments for TRL's colocated engine: ``given``, and where it says nothing, on vLLM's CPU
    backend ``enforce_eager=True`` (start-up ≈ 25 s instead of ≈ 80 s), and ``max_logprobs`` ≥ ``topk``."""
    if given is not None and not isinstance(given, dict):
        raise ValueError(f"vllm_kwargs must be a dict of vllm.LLM arguments or None, got {given!r}")
    out = dict(given or {})
    if not (getattr(cfg, "use_vllm", False) and getattr(cfg, "vllm_mode", "colocate") == "colocate"):
        if out:
            raise ValueError("vllm_kwargs: TRL builds an LLM only with use_vllm=True, vllm_mode='colocate'")
        return out
    if vllm_on_cpu():
        out.setdefault("enforce_eager", True)
    if topk > 20:  # vLLM's default max_logprobs
        out.setdefault("max_logprobs", topk)
    return out


def _main_process_value(value: Any) -> Any:
    """``value`` as the main process has it, on every process (itself where there is one process)."""
    import torch.distributed as dist

    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def logprobs_mode_verdict(client: Any) -> str | None:
    """None when the vLLM server behind TRL's ``client`` reports processed log-probs, else the error to raise
    (:func:`~offpolicy.rollout.protocols.vllm_logprobs_mode_verdict` on ``client.get_server_info()``).

    >>> from types import SimpleNamespace as NS
    >>> logprobs_mode_verdict(NS(get_server_info=lambda: {"model_config": {"logprobs_mode": "raw_logprobs"}}))[:60]
    'logprobs_mode: the vLLM server runs with --logprobs-mode raw'
    """
    from offpolicy.rollout.protocols import vllm_logprobs_mode_verdict

    return vllm_logprobs_mode_verdict(client.get_server_info())


class VLLMWiring(TRLBase):
    """The vLLM engine's arguments, log-prob mode and weight-sync check (a part of ``OffPolicyGRPOMixin``)."""

    def _setup_vllm_sync(self, train_args: Any, sync_check: str | SyncCheck | None, weights_dir: str | None) -> None:
        """The vLLM weight sync: through ``reload_weights`` on the CPU backend, verified after every sync."""
        self.offpolicy_sync: TRLSyncCheck | None = None
        if getattr(train_args, "use_vllm", False) and hasattr(getattr(self, "vllm_generation", None), "sync_weights"):
            files = uses_files(self.vllm_generation)
            if getattr(train_args, "vllm_mode", None) == "server":
                # only the main process holds TRL's client, where the choice was made; every process must push the
                # same way, or their walks over the parameters (gathers under FSDP / ZeRO-3) would not pair up
                files = _main_process_value(files)
            file_sync = FileSync(self.vllm_generation, weights_dir) if files else None
            self.offpolicy_sync = install_vllm_sync(self, sync_check, files=file_sync)

    def _request_timeouts(self) -> contextlib.AbstractContextManager[None]:
        """Server mode: every request of TRL's client answered within ``vllm_request_timeout`` seconds (None:
        ``GRPOConfig.vllm_server_timeout``), or an error naming the server, the request and the training step
        (:func:`~offpolicy.integrations.trl.patches.request_timeouts`); elsewhere nothing changes."""
        generation = getattr(self, "vllm_generation", None)
        client = getattr(generation, "vllm_client", None) if getattr(generation, "mode", None) == "server" else None
        if client is None:  # colocate, HF generate, or a process other than the one holding TRL's client
            return contextlib.nullcontext()
        timeout = getattr(self, "offpolicy_request_timeout", None)
        if timeout is None:
            timeout = float(getattr(getattr(self, "args", None), "vllm_server_timeout", 240.0))
        return request_timeouts(client, timeout,
                                when=lambda: f"training step {getattr(getattr(self, 'state', None), 'global_step', '?')}")

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``train``, with its vLLM server requests bounded (:meth:`_request_timeouts`) until it returns."""
        with self._request_timeouts():
            return super().train(*args, **kwargs)

    def _check_logprobs_mode(self, train_args: Any) -> None:
        """μ must be vLLM's processed log-probs; TRL checks the server only with its own IS correction on. The main
        process (the one holding TRL's client) asks the server and its verdict is broadcast, so every rank refuses
        at start — a rank left running would wait in TRL's first collective."""
        if not (getattr(train_args, "use_vllm", False) and getattr(train_args, "vllm_mode", None) == "server"):
            return
        accelerator = getattr(self, "accelerator", None)
        main = accelerator is None or accelerator.is_main_process
        verdict = None
        if main:
            client = getattr(getattr(self, "vllm_generation", None), "vllm_client", None)
            with self._request_timeouts():  # the server's info within the same timeout as training's requests
                verdict = None if client is None else logprobs_mode_verdict(client)
        verdict = _main_process_value(verdict)
        if verdict is not None:
            raise ValueError(verdict if main else f"rank 0 (the vLLM client's process): {verdict}")
