"""verl's CPU bridge reloading lab-moe into an in-process vLLM (CPU build); prints JSON.

Run by tests/vllm/test_verl_live.py. The bridge's ``update_weights_from_ipc_cpu`` runs on the engine's worker with
verl's ``BucketedWeightReceiver`` replaced by one that hands over the trainer's state dict in two buckets (what verl's
sender would stream, without the ZMQ / shared-memory transport). Measured: vLLM's teacher-forced log-probs of fixed
tokens after a fresh load, after vLLM's bare ``reload_weights`` of the same weights (the bug: experts left unpacked),
and after the bridge's reload of them — the mean |Δ log p| per token against the fresh load for each."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch


class Receiver:
    """Stands in for verl's ``BucketedWeightReceiver``: ``receive_weights`` hands ``BUCKETS`` to the callback."""

    BUCKETS: list[list[tuple[str, torch.Tensor]]] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs

    def receive_weights(self, on_bucket_received) -> None:
        for i, bucket in enumerate(self.BUCKETS):
            on_bucket_received(bucket, i == len(self.BUCKETS) - 1)


if __name__ == "__main__":
    from offpolicy_testkit.verl_cpu_bridge import update_weights_from_ipc_cpu, vllm_distribution_alias

    from offpolicy.models import load_model, model_path
    from offpolicy.rollout.vllm import VLLMRolloutEngine, _worker, prompt_logprobs

    sys.path.insert(0, str(vllm_distribution_alias()))  # verl looks vLLM up by the distribution name ``vllm``
    import verl.workers.rollout.vllm_rollout.bucketed_weight_transfer as transfer

    transfer.BucketedWeightReceiver = Receiver
    model, tok = load_model("lab-moe")
    engine = VLLMRolloutEngine(model_path("lab-moe"), dtype="bfloat16", max_model_len=128, seed=0)
    worker = _worker(engine.llm)
    prompts = [tok(x)["input_ids"] for x in ("abc>", "hello world>", "1 2 3>")]
    completions = [tok(x)["input_ids"] for x in ("cba", "dlrow olleh", "3 2 1")]

    def gap(reference: torch.Tensor) -> float:
        engine.llm.reset_prefix_cache()
        logp, mask = prompt_logprobs(engine.llm, prompts, completions)
        return float((logp - reference).abs()[mask].mean())

    fresh, _ = prompt_logprobs(engine.llm, prompts, completions)
    state = list(model.state_dict().items())
    result: dict = {"tensors": len(state)}
    worker.reload_weights(weights_iterator=iter(state))  # vLLM's own reload, nothing after it
    result["bare_reload_gap"] = gap(fresh)
    Receiver.BUCKETS = [state[: len(state) // 2], state[len(state) // 2 :]]
    proxy = SimpleNamespace(_get_zmq_handle=lambda: "ipc:///unused", reload_weights=worker.reload_weights,
                            model_runner=worker.model_runner)
    update_weights_from_ipc_cpu(proxy)
    result["bridge_reload_gap"] = gap(fresh)
    print("RESULT " + json.dumps(result))
