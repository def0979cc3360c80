"""verl agent loop that samples under the plug-in's recipe (DVP's min-p, top-k, top-p) and asks for the top-K.

verl's agent-loop worker builds ``sampling_params`` with temperature, top-p, top-k and ``logprobs`` only (no
``min_p``) and hands them to the rollout server, which passes them to vLLM's ``SamplingParams``. The plug-in registers
:class:`OffPolicyAgentLoop` as ``offpolicy_agent`` (verl's agent-loop registry; the worker imports the plug-in through
``actor_rollout_ref.model.external_lib``), selected by ``actor_rollout_ref.rollout.agent.default_agent_loop=
offpolicy_agent``. It is verl's single-turn loop with :func:`recipe_sampling_params` applied to every request, so the
engine samples from the same truncated distribution the trainer's engine scores (:mod:`.engine`). At construction it
refuses a config where that cannot hold (:func:`~offpolicy.integrations.verl.hosts.check_verl_host`): verl's own
``rollout.top_k`` / ``rollout.top_p`` truncating outside the recipe, a recipe under a non-vLLM rollout or an actor
strategy without the plug-in's engine.

Top-K (``topk_logprobs: K``): verl 0.9.1's vLLM server sets ``logprobs`` to 0 (the sampled token only), so the loop
asks the same server to score the finished sequence once more — ``max_tokens=1``, ``prompt_logprobs=K`` — and parses
the answer (:func:`topk_from_prompt_logprobs`) into ``extra_fields["rollout_topk_ids"]`` / ``["rollout_topk_logprobs"]``
(lists of response length × K). vLLM computes prompt log-probs from the raw logits: no temperature, no top-k / top-p /
min-p, whatever the request says (vLLM 0.32 ``vllm/v1/worker/gpu_model_runner.py``, "prompt tokens skip sampling
processors"; checked on a live server in tests/vllm/test_verl_live.py). So the top-K is the raw model's at
temperature 1 — the sampler's distribution only when the rollout samples at temperature 1 (a recipe's truncation is
not in it, as it is not in π_old's bounds either). A sampling request at another temperature with ``topk_logprobs`` is
refused (:func:`check_topk_temperature`); greedy requests (validation) are scored as they are. The scoring request is
a prefill forward, not the decode forward that sampled: on the live CPU server in float32 the two agree to ~1e-5.

The output is an :class:`OffPolicyAgentLoopOutput`, whose ``as_dict()`` — what verl 0.9's TransferQueue agent loop
(``AgentLoopWorkerTQ._agent_loop_postprocess``) stores per sample — turns those lists into the tensors
``offpolicy_topk_ids`` / ``offpolicy_topk_logp`` ``[prompt + response, K]`` (:func:`~.topk.sequence_topk`), fields of the
training batch like ``teacher_logprobs``; the engine computes TRM's bounds from them (:mod:`.topk`). verl's legacy
(DataProto) agent loop keeps ``extra_fields`` as non-tensor arrays: top-K TRM needs the v1 trainer.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from offpolicy.integrations.verl.hosts import AGENT_NAME, check_verl_host
from offpolicy.integrations.verl.settings import VerlSettings, settings_from_environment
from offpolicy.integrations.verl.topk import (
    TOPK_IDS_FIELD,
    TOPK_LOGP_FIELD,
    sequence_topk,
)


def recipe_sampling_params(sampling_params: dict[str, Any], settings: VerlSettings) -> dict[str, Any]:
    """A copy of verl's ``sampling_params`` with the recipe's ``min_p`` / ``top_k`` / ``top_p`` set.

    Greedy requests (``temperature == 0``, verl's validation and REMAX baselines) are left alone.

    >>> from offpolicy.integrations.verl.settings import parse_settings
    >>> recipe_sampling_params({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True},
    ...                        parse_settings({"sampling": {"min_p": 0.01}}))
    {'temperature': 1.0, 'top_p': 1.0, 'top_k': -1, 'logprobs': True, 'min_p': 0.01}
    """
    out = dict(sampling_params)
    if float(out.get("temperature", 1.0)) == 0.0:
        return out
    out.update(settings.sampling.sampling_params())
    return out


def check_topk_temperature(sampling_params: dict[str, Any]) -> None:
    """Refuse top-K scoring of a rollout sampled at a temperature other than 1 (greedy, 0, is allowed).

    vLLM's ``prompt_logprobs`` are log softmax of the raw logits whatever the request's temperature, so at T ≠ 1 they
    are not the distribution that sampled, and the engine's bounds (π_old at verl's temperature) and score centering
    would compare two different distributions.

    >>> check_topk_temperature({"temperature": 1.0})
    >>> check_topk_temperature({"temperature": 0.7})
    Traceback (most recent call last):
    ...
    ValueError: offpolicy.topk_logprobs: the rollout samples at temperature 0.7, but vLLM's prompt_logprobs (the top-K) are the raw model's at temperature 1: set actor_rollout_ref.rollout.temperature=1.0 or topk_logprobs: 0
    """
    t = float(sampling_params.get("temperature", 1.0))
    if t not in (0.0, 1.0):
        raise ValueError(f"offpolicy.topk_logprobs: the rollout samples at temperature {t:g}, but vLLM's "
                         "prompt_logprobs (the top-K) are the raw model's at temperature 1: set "
                         "actor_rollout_ref.rollout.temperature=1.0 or topk_logprobs: 0")


def topk_from_prompt_logprobs(extra_fields: dict[str, Any], n_prompt: int, n_response: int,
                              k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The response positions' top-K ``(ids, logprobs)`` from a scoring request's ``extra_fields``.

    verl's server returns ``prompt_ids`` / ``prompt_logprobs`` with one row per prompt token after the first (the
    distribution that predicted it), ranks 1…K, plus a dummy last row. Response token j of the scored sequence
    (prompt + response) is sequence token ``n_prompt + j``, predicted by row ``n_prompt + j − 1``.

    >>> fields = {"prompt_ids": [[5, 6], [7, 8], [9, 1], [0, 0]],
    ...           "prompt_logprobs": [[-0.1, -2.0], [-0.2, -3.0], [-0.3, -4.0], [0.0, 0.0]]}
    >>> topk_from_prompt_logprobs(fields, n_prompt=2, n_response=2, k=2)
    ([[7, 8], [9, 1]], [[-0.2, -3.0], [-0.3, -4.0]])
    """
    ids, logps = extra_fields.get("prompt_ids"), extra_fields.get("prompt_logprobs")
    if ids is None or logps is None:
        raise ValueError("the scoring request's extra_fields lack prompt_ids / prompt_logprobs (top-K not returned)")
    rows = range(n_prompt - 1, n_prompt - 1 + n_response)
    if len(ids) < n_prompt - 1 + n_response or len(logps) != len(ids):
        raise ValueError(f"prompt_logprobs has {len(logps)} rows for {len(ids)} ids; need "
                         f"{n_prompt - 1 + n_response} (prompt {n_prompt} + response {n_response} − 1)")
    out_ids, out_logps = [list(ids[r]) for r in rows], [list(logps[r]) for r in rows]
    for r, (row_ids, row_logps) in enumerate(zip(out_ids, out_logps)):
        if len(row_ids) != k or len(row_logps) != k or any(v is None for v in row_ids + row_logps):
            raise ValueError(f"prompt_logprobs row {r + n_prompt - 1}: expected {k} entries, got {row_logps!r}")
    return out_ids, out_logps


def check_response_logprobs(sampling_params: dict[str, Any], response_ids: list[int],
                            response_logprobs: list[float] | None, *, where: str) -> None:
    """Refuse, naming ``where`` (the sample), a rollout that asked for log-probs and got fewer than its response
    tokens: verl pads ``response_logprobs`` with 0.0 to the response length (μ = 1 at every missing token).

    >>> check_response_logprobs({"logprobs": True}, [5, 6, 7], [-0.1, -0.2], where="sample 4")
    Traceback (most recent call last):
    ...
    ValueError: sample 4: 3 response tokens but 2 rollout log-probs from the server (verl would pad μ = 1)
    """
    if sampling_params.get("logprobs") in (None, False) or not response_ids:
        return
    n = 0 if response_logprobs is None else len(response_logprobs)
    if n != len(response_ids):
        raise ValueError(f"{where}: {len(response_ids)} response tokens but {n} rollout log-probs from the server "
                         "(verl would pad μ = 1)")


def _sample_name(kwargs: dict[str, Any]) -> str:
    """The sample as the dataset names it (its ``index`` / ``uid`` fields, when the batch carries them)."""
    named = [f"{key} {kwargs[key]}" for key in ("uid", "index") if kwargs.get(key) is not None]
    return "offpolicy_agent sample" + (f" ({', '.join(named)})" if named else "")


class OffPolicyAgentLoopOutput(AgentLoopOutput):
    """verl's ``AgentLoopOutput`` whose ``as_dict()`` also returns the top-K as training-batch tensors."""

    def as_dict(self) -> dict[str, Any]:
        out = super().as_dict()
        extra = out.get("extra_fields") or {}
        if "rollout_topk_ids" in extra:
            k = int(extra.pop("rollout_topk_k"))
            ids, logps = extra.pop("rollout_topk_ids"), extra.pop("rollout_topk_logprobs")
            out[TOPK_LOGP_FIELD], out[TOPK_IDS_FIELD] = sequence_topk(int(out["prompts"].numel()), ids, logps, k)
        return out


def with_topk_output(output: AgentLoopOutput) -> OffPolicyAgentLoopOutput:
    """``output`` as an :class:`OffPolicyAgentLoopOutput` (the same values; the same set fields, which
    ``as_dict`` dumps)."""
    values = {name: getattr(output, name) for name in type(output).model_fields}
    return OffPolicyAgentLoopOutput.model_construct(_fields_set=set(output.model_fields_set), **values)


@register(AGENT_NAME)
class OffPolicyAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn agent loop, sampling under the plug-in's recipe; top-K attached when asked."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.offpolicy = settings_from_environment()
        # verl's full config: no truncation the actor does not replay, no recipe a non-vLLM rollout cannot honour
        check_verl_host(self.config, self.offpolicy, sync_check=False, agent_loop=True)

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any) -> Any:
        params = recipe_sampling_params(sampling_params, self.offpolicy)
        k = self.offpolicy.topk_logprobs
        if k > 0:
            check_topk_temperature(params)  # before the generation: the first request of a run fails
        output = await super().run(params, priority=priority, **kwargs)
        check_response_logprobs(params, list(output.response_ids), output.response_logprobs,
                                where=_sample_name(kwargs))
        if k <= 0:
            return output
        ids: list[list[int]] = []
        logps: list[list[float]] = []
        if output.response_ids:
            score: dict[str, Any] = {key: params[key] for key in ("temperature", "top_k", "top_p", "min_p")
                                     if key in params}
            scored = await self.server_manager.generate(
                request_id=f"offpolicy-topk-{id(output)}",
                prompt_ids=list(output.prompt_ids) + list(output.response_ids),
                sampling_params={**score, "max_tokens": 1, "prompt_logprobs": k},
            )
            try:
                ids, logps = topk_from_prompt_logprobs(scored.extra_fields, len(output.prompt_ids),
                                                       len(output.response_ids), k)
            except ValueError as err:
                raise ValueError(f"{_sample_name(kwargs)}, top-K scoring request offpolicy-topk-{id(output)}: "
                                 f"{err}") from None
        output = with_topk_output(output)
        # every sample carries the fields (verl stacks a field only when all samples of a put have it)
        output.extra_fields.update(rollout_topk_ids=ids, rollout_topk_logprobs=logps, rollout_topk_k=k)
        return output
