"""The sync check (:mod:`offpolicy.rollout.sync_check`) inside verl's own trainer: after every weight sync.

verl 0.9.1's ``sync`` v1 trainer pushes the actor's weights into the rollout replicas in two places —
``PPOTrainerSync.on_init_end`` (the initial sync, after a checkpoint may have been loaded) and
``PPOTrainerSync.on_step_end`` (after every step's actor update), both ``self.checkpoint_manager.update_weights`` —
and merges whatever ``on_step_end`` leaves in ``self._pending_sync_metrics`` into the step's logged metrics
(``PPOTrainer._consume_sync_metrics``). The plug-in's trainer (:func:`~offpolicy.integrations.verl.driver.make_trainer_class`)
extends those two hooks: after verl's push,

* the engine scores the probe through verl's own ``LLMServerClient`` (the client the agent loops use; one request
  per row, ``prompt_logprobs=0``: each given token's raw log-prob at T = 1) — :class:`VerlClientScorer`; where verl
  runs several rollout replicas (its hybrid engine makes one per ``tensor_model_parallel_size`` trainer ranks: with
  two FSDP ranks and TP = 1, two vLLM servers, each fed by its own rank's push), every replica is scored on its own
  server (:class:`ServerClient`) and judged by a check of its own — the load balancer would score whichever replica
  it picks, and a replica that missed its push would go unseen;
* the actor scores it through verl's worker group, ``actor_rollout_wg.compute_log_prob`` — the same forward verl's
  old-log-prob step runs (FSDP engine, its dtype and kernels), at temperature 1, dispatched to every data-parallel
  rank (each FSDP rank's forward all-gathers the shards, so every rank must join) — :func:`actor_probe_logprobs`;
* :class:`~offpolicy.rollout.sync_check.SyncCheck` calibrates on the initial sync (both sides load one checkpoint:
  the run's own numerical mismatch) and judges every later one (the gap, the engine's motion, the staleness β).

The probe is :meth:`SyncProbe.from_text` through the trainer's tokenizer: the calibration runs at the initial sync,
before any rollout exists. The metrics go to verl's logger as ``sync/*``; a failed sync raises
:class:`~offpolicy.rollout.sync_check.SyncCheckError` naming the step (``sync_check: error``, the default) or logs a
warning with ``sync/ok = 0`` (``warn``); ``off`` skips it. Set in the plug-in's settings (``OFFPOLICY_VERL``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import time
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any

import torch
from torch import Tensor

from offpolicy.integrations.verl.settings import PLAIN_LOG_PROBS, SYNC_CHECK_MODES, SYNC_CHECK_TIMEOUT
from offpolicy.rollout.http import ServerError
from offpolicy.rollout.sync_check import SyncCheck, SyncProbe

logger = logging.getLogger(__name__)


def run_coroutine(coro: Coroutine) -> Any:
    """``coro``'s result from synchronous code: on a fresh event loop in this thread, or in a helper thread when
    this thread already runs one (verl's trainer hooks are synchronous; its client is async)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class VerlClientScorer:
    """``score(prompt_ids, completion_ids) -> (logp [B, T], mask [B, T])`` through verl's ``LLMServerClient``: one
    request per row with ``max_tokens=1`` and ``prompt_logprobs=0``; the server's prompt log-probs are the raw
    model's (T = 1), each given token's own (the sync check's engine interface)."""

    TIMEOUT = SYNC_CHECK_TIMEOUT  # OFFPOLICY_VERL's sync_check_timeout when the block does not set it

    def __init__(self, client: Any, timeout: float = TIMEOUT) -> None:
        self.client, self.timeout, self.calls = client, timeout, 0

    async def _score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[Any]:
        requests = []
        for p, c in zip(prompt_ids, completion_ids):
            self.calls += 1
            requests.append(self.client.generate(
                f"offpolicy-sync-probe-{self.calls}", prompt_ids=list(p) + list(c),
                sampling_params={"temperature": 1.0, "max_tokens": 1, "prompt_logprobs": 0}))
        return await asyncio.wait_for(asyncio.gather(*requests), self.timeout)

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> tuple[Tensor, Tensor]:
        try:
            outs = run_coroutine(self._score(prompt_ids, completion_ids))
        except TimeoutError:  # asyncio.wait_for's: the server took the requests and never answered
            raise ServerError(f"verl's rollout server did not answer the sync check's probe ({len(prompt_ids)} "
                              f"sequences) within {self.timeout:g} s: is it running? (OFFPOLICY_VERL: sync_check_timeout)"
                              ) from None
        width = max(len(c) for c in completion_ids)
        logp = torch.zeros(len(prompt_ids), width)
        mask = torch.zeros(len(prompt_ids), width, dtype=torch.bool)
        for i, (p, c, out) in enumerate(zip(prompt_ids, completion_ids, outs)):
            rows = slice(len(p) - 1, len(p) - 1 + len(c))  # row j predicts token j + 1 (row 0 is the first token's)
            extra = out.extra_fields
            if "prompt_logprobs" not in extra:
                raise ValueError("sync check: verl's server answered without prompt_logprobs (prompt_logprobs=0 "
                                 "was asked; does the rollout server support it?)")
            ids = [row[0] for row in extra["prompt_ids"][rows]]
            if ids != list(c):
                raise ValueError(f"sync check: probe row {i}: the server scored the tokens {ids}, not {list(c)}")
            logp[i, :len(c)] = torch.tensor([row[0] for row in extra["prompt_logprobs"][rows]])
            mask[i, :len(c)] = True
        return logp, mask


class ServerClient:
    """``LLMServerClient.generate`` on one rollout server (verl's server actor handle, one per replica:
    ``trainer.llm_server_manager.server_handles``) — the sync check scores each replica on its own server instead of
    the one verl's load balancer picks. The request id sent to vLLM is made unique per request, as verl's client
    does."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> Any:
        return await self.handle.generate.remote(prompt_ids=prompt_ids, sampling_params=sampling_params,
                                                 request_id=f"{request_id}-{uuid.uuid4().hex}")


def probe_batch(probe: SyncProbe, *, multiple: int = 1) -> Any:
    """The probe as verl's v1 trainer hands a batch to ``compute_log_prob``: one row per sequence with the fields
    the agent loop stores in the TransferQueue (``prompts``, ``responses``, ``input_ids`` = prompt + response,
    ``position_ids``, ``attention_mask``, ``response_mask`` / ``loss_mask`` all ones), jagged, and the step's
    metadata (temperature 1, no loss, one micro-batch per rank, the plain log-probs: no sampling recipe). Rows are repeated (the last one) up to a ``multiple`` of the data-parallel
    size, which verl's dispatch splits evenly."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    prompts, completions = list(probe.prompt_ids), list(probe.completion_ids)
    while len(prompts) % multiple:
        prompts.append(prompts[-1])
        completions.append(completions[-1])
    rows = []
    for p, c in zip(prompts, completions):
        input_ids = torch.tensor(list(p) + list(c), dtype=torch.int64)
        response_mask = torch.ones(len(c), dtype=torch.int64)
        rows.append({"prompts": torch.tensor(p, dtype=torch.int64), "responses": torch.tensor(c, dtype=torch.int64),
                     "input_ids": input_ids, "position_ids": torch.arange(len(input_ids)),
                     "attention_mask": torch.ones_like(input_ids), "response_mask": response_mask,
                     "loss_mask": response_mask.clone()})
    # jagged even when every row has one length (verl's forward and response_from_nested read the offsets)
    data = TensorDict({key: torch.nested.as_nested_tensor([row[key] for row in rows], layout=torch.jagged)
                       for key in rows[0]}, batch_size=len(rows))
    # one micro-batch per rank (the probe is a few short rows): verl's engine takes the batch's own micro-batch
    # settings before its config's, whose micro-batch size need not divide the probe's rows
    # the model's plain log-probs, without the plug-in's sampling recipe (DVP, replay) or top-K work: the engine side
    # is vLLM's prompt log-probs, which no sampler touches
    tu.assign_non_tensor(data, temperature=1.0, compute_loss=False, calculate_entropy=False,
                         global_token_num=[len(p) + len(c) for p, c in zip(prompts, completions)],
                         use_dynamic_bsz=False, micro_batch_size_per_gpu=len(prompts) // multiple,
                         **{PLAIN_LOG_PROBS: True})
    return data


def actor_probe_logprobs(worker_group: Any, probe: SyncProbe, *, dp_size: int = 1) -> tuple[Tensor, Tensor]:
    """The actor's log-probs of the probe's completions, ``(logp [B, T], mask [B, T])``, from verl's
    ``compute_log_prob`` on ``worker_group`` (the actor's own forward, at temperature 1)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import response_from_nested

    data = probe_batch(probe, multiple=dp_size)
    output = worker_group.compute_log_prob(data)
    logp = response_from_nested(tu.get(output, "log_probs"), data["response_mask"])
    logp = logp.to_padded_tensor(0.0) if logp.is_nested else logp
    rows = len(probe.prompt_ids)
    width = max(len(c) for c in probe.completion_ids)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for i, c in enumerate(probe.completion_ids):
        mask[i, :len(c)] = True
    out = torch.zeros(rows, width)
    out[:, :logp.shape[1]] = logp[:rows, :width].float().cpu()
    return out * mask, mask


class VerlSyncCheck:
    """The check the plug-in's trainer runs after verl's weight syncs: ``engine`` scores like
    :class:`VerlClientScorer` (or is a sequence of such scorers, one per rollout replica),
    ``actor(probe) -> (logp [B, T], mask [B, T])`` scores on the trainer's side.

    :meth:`after_sync` calibrates on the first call (the initial sync) and judges every later one; it returns
    the ``sync/*`` metrics and counts the checks (``checks``, ``passed``). With several replicas each has its own
    :class:`~offpolicy.rollout.sync_check.SyncCheck` (its own baseline: replicas round alike but are calibrated
    apart), the actor is scored once per sync, a failure names the replica, and the metrics are the worst replica's
    (largest gap over its threshold) with ``sync/ok`` the least over replicas and ``sync/replicas`` their count."""

    def __init__(self, engine: Any, actor: Any, probe: SyncProbe, *, on_failure: str = "error",
                 check: SyncCheck | None = None) -> None:
        if on_failure not in ("error", "warn"):
            raise ValueError(f"sync_check must be one of {SYNC_CHECK_MODES}, got {on_failure!r}")
        self.engines = list(engine) if isinstance(engine, Sequence) else [engine]
        if not self.engines:
            raise ValueError("engine: at least one rollout replica's scorer is needed, got an empty sequence")
        self.engine, self.actor, self.probe = self.engines[0], actor, probe
        self.check = check or SyncCheck(on_failure=on_failure)
        self.check.probe = probe
        # one check per replica, alike before calibration (a copy of the first, however it was configured)
        self.replica_checks = [self.check] + [copy.deepcopy(self.check) for _ in self.engines[1:]]
        self.checks = self.passed = 0

    def _actor_scores(self) -> tuple[Tensor, Tensor]:
        actor_logp, actor_mask = self.actor(self.probe)
        mask = actor_mask.bool().cpu()
        return actor_logp.float().cpu() * mask, mask

    def _engine_scores(self, engine: Any, mask: Tensor, where: str = "") -> Tensor:
        try:
            engine_logp, engine_mask = engine.score(self.probe.prompt_ids, self.probe.completion_ids)
        except ServerError as err:  # the scorer knows the server, the check knows the step and the replica
            raise ServerError(f"{where}: {err}") from None
        if not torch.equal(engine_mask.bool().cpu(), mask):
            raise ValueError("sync check: the engine and the actor scored different tokens of the probe")
        return engine_logp.float().cpu() * mask

    def _replica_sync(self, index: int, actor_logp: Tensor, mask: Tensor, step: int) -> dict[str, float]:
        """Calibrate (first sync) or judge replica ``index`` against the actor's log-probs of this sync."""
        start = time.perf_counter()
        engine, check = self.engines[index], self.replica_checks[index]
        where = f" (replica {index} of {len(self.engines)})" if len(self.engines) > 1 else ""
        when = f"verl step {step}'s weight sync{where}"
        engine_logp = self._engine_scores(engine, mask, when)
        if check.baseline is None:
            again = self._engine_scores(engine, mask, when)
            return check.calibrate_from(engine_logp, actor_logp, mask, again=again,
                                        seconds=time.perf_counter() - start)
        return check.judge_scores(engine_logp, actor_logp, mask, seconds=time.perf_counter() - start,
                                  what=f"verl step {step}: weight sync into the rollout engine{where}")

    def after_sync(self, step: int) -> dict[str, float]:
        """Score the probe on both sides and calibrate (first call) or judge the sync of ``step``, every replica."""
        start = time.perf_counter()
        actor_logp, mask = self._actor_scores()
        per_replica = [self._replica_sync(i, actor_logp, mask, step) for i in range(len(self.engines))]
        metrics = dict(max(per_replica, key=lambda m: m["sync/gap"] / max(m["sync/threshold"], 1e-30)))
        metrics["sync/ok"] = min(m["sync/ok"] for m in per_replica)
        metrics["sync/seconds"] = time.perf_counter() - start
        if len(self.engines) > 1:
            metrics["sync/replicas"] = float(len(self.engines))
        self.checks += 1
        self.passed += int(metrics["sync/ok"] == 1.0)
        metrics["sync/checks"], metrics["sync/passed"] = float(self.checks), float(self.passed)
        logger.info("sync check after the weight sync of step %d: %s", step,
                    {k: round(v, 6) for k, v in metrics.items()})
        return metrics


def engine_scorers(trainer: Any, timeout: float = SYNC_CHECK_TIMEOUT) -> list[Any]:
    """One scorer per rollout replica: each replica's own server where verl runs several
    (``llm_server_manager.server_handles``), else verl's ``LLMServerClient``; each waits ``timeout`` seconds
    (``OFFPOLICY_VERL``'s ``sync_check_timeout``) for its probe. A trainer without ``get_llm_client`` (verl's
    separated loops) scores each server it holds directly — the fully async trainer holds no server manager, only
    its checkpoint manager's replicas (each replica's ``_server_handle``)."""
    handles = list(getattr(getattr(trainer, "llm_server_manager", None), "server_handles", None) or [])
    if not handles:
        replicas = getattr(getattr(trainer, "checkpoint_manager", None), "replicas", None) or []
        handles = [r._server_handle for r in replicas if getattr(r, "_server_handle", None) is not None]
    if len(handles) > 1 or (handles and not hasattr(trainer, "get_llm_client")):
        return [VerlClientScorer(ServerClient(handle), timeout) for handle in handles]
    return [VerlClientScorer(trainer.get_llm_client(), timeout)]


def from_trainer(trainer: Any, on_failure: str, timeout: float = SYNC_CHECK_TIMEOUT) -> VerlSyncCheck:
    """The check for a verl v1 ``PPOTrainer`` after its setup: its rollout replicas (:func:`engine_scorers`), its
    actor worker group (data-parallel size from verl's dispatch info) and the probe from its tokenizer."""
    import os

    logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))  # as verl's own modules log in its processes
    probe = SyncProbe.from_text(trainer.tokenizer)
    wg = trainer.actor_rollout_wg
    dp_size = 1
    try:  # verl's dispatch: the data-parallel rank of every worker of the actor mesh
        mapping = wg._query_dispatch_info("actor")
        dp_size = max(mapping) + 1
    except Exception as err:  # noqa: BLE001 - a worker group without the query: one rank
        logger.info("sync check: no dispatch info for the actor mesh (%s); data-parallel size 1", err)
    engines = engine_scorers(trainer, timeout)
    logger.info("sync check: %d rollout replica(s), actor data-parallel size %d", len(engines), dp_size)
    return VerlSyncCheck(engines if len(engines) > 1 else engines[0],
                         lambda probe: actor_probe_logprobs(wg, probe, dp_size=dp_size), probe,
                         on_failure=on_failure)


__all__ = ["ServerClient", "VerlClientScorer", "VerlSyncCheck", "actor_probe_logprobs",
           "engine_scorers", "from_trainer", "probe_batch", "run_coroutine"]
