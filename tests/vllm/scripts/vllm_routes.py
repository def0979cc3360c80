"""Whether vLLM (here: its CPU build) can return routed experts on lab-moe; prints JSON.

Run by tests/vllm/test_engine_live.py. Three answers: :func:`offpolicy.rollout.vllm.routes_unavailable`'s reason, the
engine's one-line refusal of ``record_routes``, and vLLM's own answer to ``enable_return_routed_experts`` without the
engine's check in front (the claim the refusal rests on, checked against the installed vLLM)."""

from __future__ import annotations

import json

if __name__ == "__main__":
    from offpolicy.models import model_path
    from offpolicy.rollout.vllm import VLLMRolloutEngine, routes_unavailable

    path = model_path("lab-moe")
    result: dict = {"reason": routes_unavailable()}
    try:
        VLLMRolloutEngine(path, record_routes=True, max_model_len=128)
        result["engine"] = None
    except ValueError as err:
        result["engine"] = str(err)
    import vllm

    try:  # vLLM's own check (config validation, before any weight is loaded)
        vllm.LLM(model=str(path), enable_return_routed_experts=True, max_model_len=128, enforce_eager=True)
        result["vllm"] = None
    except Exception as err:  # noqa: BLE001 - pydantic's ValidationError or vLLM's ValueError: the text is the answer
        result["vllm"] = f"{type(err).__name__}: {err}"
    print("RESULT " + json.dumps(result))
