"""What offpolicy adds to a vLLM server's workers: vLLM's own hook for it, ``--worker-extension-cls`` (its methods
join the worker's, and the dev-mode ``/collective_rpc`` endpoint calls them by name).

:class:`~offpolicy.rollout.vllm_server.VLLMServer` starts every server with :data:`WORKER_EXTENSION`;
:func:`offpolicy.rollout.protocols.vllm_reload_weights` calls
:meth:`OffpolicyWorkerExtension.offpolicy_repack_cpu_experts` after each ``reload_weights``: on vLLM 0.32's CPU backend the reload leaves a mixture-of-experts model's fused experts
unpacked (:func:`repack_cpu_experts`, which the in-process push and verl's CPU bridge call too), elsewhere it does
nothing. This module imports vLLM only inside :func:`repack_cpu_experts`; the server's worker process imports it.
"""

from __future__ import annotations

from typing import Any

WORKER_EXTENSION = "offpolicy.rollout.vllm_worker.OffpolicyWorkerExtension"
REPACK_METHOD = "offpolicy_repack_cpu_experts"


class OffpolicyWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls`` (``self`` is the worker)."""

    model_runner: Any  # the worker's

    def offpolicy_repack_cpu_experts(self) -> int:
        """Prepack the fused-MoE experts again after a reload (:func:`repack_cpu_experts`);
        returns the number of layers repacked (0 on a dense model, a GPU, or another vLLM version)."""
        return repack_cpu_experts(self.model_runner.model)


# vLLM versions whose CPU backend's reload leaves fused-MoE experts unpacked (checked on 0.32: see repack_cpu_experts)
CPU_EXPERTS_REPACK_VERSIONS = ("0.32.",)


def repack_cpu_experts(model: Any) -> int:
    """Prepack every fused-MoE layer's experts again after a ``reload_weights`` on vLLM's CPU backend; returns the
    number of layers repacked (0 on a dense model, another backend or another vLLM version).

    At load, vLLM 0.32's CPU experts (``CPUUnquantizedExperts`` and its per-ISA subclasses) prepack ``w13_weight`` / ``w2_weight`` into the
    layout of their grouped GEMM; its layer-wise reload writes the new weights back in the checkpoint's layout
    without that step, and the kernel reads them as packed: on lab-moe the engine's log-probs move from 0.009 to 0.19
    nats per token from the trainer's with the same weights on both sides. This runs the step the first load ran
    (the layer's own ``process_weights_after_loading``), after which the engine is back at 0.009 exactly. A server's
    reload from a folder and verl's CPU bridge leave the experts the same way (lab-moe: 2.7 and 3.3 nats per token
    from a fresh load of the same weights; 0 once repacked)."""
    import vllm

    if not str(getattr(vllm, "__version__", "")).startswith(CPU_EXPERTS_REPACK_VERSIONS):
        return 0
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        # the portable kernel or its per-ISA subclasses (X86CPUUnquantizedExperts on an AMX CPU, Arm…, Power…),
        # which share its prepacking
        if experts is not None and any(c.__name__ == "CPUUnquantizedExperts" for c in type(experts).__mro__):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked
