"""Every weight transfer of TRL 1.16's asynchronous trainer verified (imports no TRL): after ``_sync_weight`` has
streamed the weights (``weight_transfer=``) and told the rollout worker the new version, the engine must report that
version and hold those weights.

Two judgements, at every transfer, the cold one before the first step included:

* **the version** — the rollout worker's ``model_version`` (TRL's ``AsyncRolloutWorker`` shares it with its child
  process; it tags every sample with it) must be the trainer's: a worker left at an older version tags its samples
  with the wrong version, and the staleness d = v_θ − v_sample (what the log-linear π_prox reads) is wrong;
* **the weights** — :class:`~offpolicy.rollout.sync_check.SyncCheck`, the check of ``OffPolicyGRPOTrainer``'s syncs:
  the engine and the trainer score a fixed text probe (:func:`~offpolicy.integrations.trl.vllm_sync.default_probe`);
  the gap, the engine's motion and the staleness β against the run's own noise (calibrated before the cold transfer,
  when both sides hold the checkpoint), and, where the engine's tensors are readable in this process
  (``engine_parameters()``), the parameter layer (:mod:`offpolicy.rollout.param_check`): every engine tensor whose
  trainer source changed must have changed — it names a tensor a transfer dropped.

The engine (:func:`transfer_engine`): the rollout worker itself when it can score given tokens (``score(prompt_ids,
completion_ids) -> (logp [B, T], mask [B, T])``, and ``engine_parameters()`` for the parameter layer: the test kit's
workers); otherwise, for TRL's own ``AsyncRolloutWorker``, the vLLM server it samples from
(``AsyncGRPOConfig.vllm_server_base_url``, through its prompt log-probs: ``/v1/completions``), asked for the model
name TRL's worker requests. A custom worker that can do neither is refused at construction, naming ``sync_check``.

A failed judgement raises :class:`~offpolicy.rollout.sync_check.SyncCheckError` in one line naming the step, the
version and the metric (or tensor), on every rank; with ``"warn"`` it is logged and ``sync/ok`` = 0. The numbers go to
TRL's log as ``sync/…`` (``sync/gap``, ``sync/baseline``, ``sync/ok``, ``sync/seconds``…). The trainer scores the
probe with its model's attention switched to SDPA for the forward (TRL trains with its packed tree attention, which
needs the packing's indices), restored after. With several processes every rank runs the probe's trainer forward at
the same points (FSDP gathers); the main process — the only one holding TRL's worker — scores the engine and judges.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from offpolicy.integrations.trl.ranks import every_rank_raises
from offpolicy.integrations.trl.vllm_sync import _eval, default_probe
from offpolicy.rollout.sync_check import SyncCheck, SyncCheckError

logger = logging.getLogger(__name__)

__all__ = ["AsyncTransferCheck", "served_model_name", "transfer_engine"]


def served_model_name(trainer: Any) -> str:
    """The model name TRL 1.16's ``AsyncRolloutWorker`` asks the vLLM server for: the base model's id, or under
    TRL's adapter sync (a PEFT model, a server with ``--enable-lora``) the adapter of the current version,
    ``{lora_name}-v{model_version}``.

    >>> from types import SimpleNamespace as NS
    >>> served_model_name(NS(_lora_sync=True, _lora_name="trl-policy", model_version=3))
    'trl-policy-v3'
    """
    if getattr(trainer, "_lora_sync", False):
        return f"{trainer._lora_name}-v{int(trainer.model_version)}"
    worker = getattr(trainer, "rollout_worker", None)
    name = getattr(worker, "_loop_kwargs", {}).get("model_name") if worker is not None else None
    if name is None:
        from trl.trainer.utils import get_config_model_id

        name = get_config_model_id(trainer.accelerator.unwrap_model(trainer.model).config)
    return str(name)


class _ServedModel:
    """A vLLM server's prompt log-probs (:class:`~offpolicy.rollout.server_engine.ServerRolloutEngine`), asked each
    time for the model the worker samples from (under adapter sync, a new name per version)."""

    def __init__(self, trainer: Any) -> None:
        from offpolicy.rollout.protocols import VLLMProtocol
        from offpolicy.rollout.server_engine import ServerRolloutEngine

        self.trainer = trainer
        args = trainer.args
        self.protocol = VLLMProtocol(served_model_name(trainer))
        self.engine = ServerRolloutEngine(str(args.vllm_server_base_url), self.protocol,
                                          timeout=float(getattr(args, "vllm_server_timeout", 240.0)))

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        self.protocol.model = served_model_name(self.trainer)
        return self.engine.score(prompt_ids, completion_ids)


def transfer_engine(trainer: Any) -> Any:
    """What the check scores on the main process (see the module docstring): the rollout worker when it has
    ``score``, the vLLM server of TRL's ``AsyncRolloutWorker``, else a ``ValueError`` naming ``sync_check``."""
    worker = trainer.rollout_worker
    if callable(getattr(worker, "score", None)):
        return worker
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    if isinstance(worker, AsyncRolloutWorker):
        return _ServedModel(trainer)
    raise ValueError(f"sync_check: the rollout worker {type(worker).__name__} cannot score given tokens (give it "
                     "score(prompt_ids, completion_ids) -> (logp [B, T], mask [B, T]) under the engine's numerics) and "
                     "is not TRL's AsyncRolloutWorker, whose vLLM server is scored instead; pass sync_check=None to "
                     "train unchecked")


@contextlib.contextmanager
def plain_attention(model: torch.nn.Module) -> Iterator[None]:
    """Inside, ``model`` (TRL's policy, built with its packed ``"tree_fa3"`` attention) runs SDPA — what an unpacked
    forward needs; the attention implementation is restored after."""
    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    if config is None or before in (None, "sdpa", "eager"):
        yield
        return
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = before


class AsyncTransferCheck:
    """Runs around ``AsyncGRPOTrainer._sync_weight`` (``push``): calibrates :attr:`check` before the first transfer,
    pushes, then judges the engine's version and weights (see the module docstring). Each transfer's numbers go to
    ``trainer._metrics["train"]`` as ``sync/…`` (TRL averages each key over the logging window)."""

    def __init__(self, trainer: Any, check: SyncCheck) -> None:
        self.trainer, self.check = trainer, check
        self.main = bool(trainer.accelerator.is_main_process)
        if check.probe is None:
            check.probe = default_probe(trainer.processing_class)
        self.engine = transfer_engine(trainer) if self.main else None
        self.calibrated = False
        self.transfers = 0

    def _model(self) -> torch.nn.Module:
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    def _what(self) -> str:
        return (f"weight transfer {self.transfers} at step {self.trainer.state.global_step} "
                f"(model version {int(self.trainer.model_version)})")

    @contextlib.contextmanager
    def _trainer_forward(self) -> Iterator[None]:
        model = self._model()
        with _eval(model), plain_attention(model):
            yield

    def __call__(self, push: Any) -> None:
        self.transfers += 1
        with every_rank_raises():  # a failed check on the main process stops every rank, naming it
            if self.main:
                self._check_main(push)
            else:
                self._join(push)

    def _join(self, push: Any) -> None:
        """A rank that does not judge runs the probe's trainer forward as often as the main one does."""
        with self._trainer_forward():
            if not self.calibrated:
                self.calibrated = True
                self.check._score_trainer(self._model())
            push()
            self.check._score_trainer(self._model())

    def _check_main(self, push: Any) -> None:
        check, model, deferred = self.check, self._model(), False
        if not self.calibrated:
            self.calibrated = True
            try:
                with self._trainer_forward():
                    check.calibrate(self.engine, model)
            except SyncCheckError as err:  # the trainer's model is not the checkpoint the engine loaded
                logger.warning("sync check: %s; the trainer's model is not the checkpoint the engine holds: the check "
                               "calibrates right after the first transfer instead, which it then cannot verify", err)
                deferred = True
        start = time.perf_counter()
        push()
        pushed = time.perf_counter() - start
        version_ok = self._judge_version()
        with self._trainer_forward():
            if deferred:  # raises if the two sides still differ: the first transfer did not take
                metrics = check.calibrate(self.engine, model)
            else:
                metrics = check.after_sync(self.engine, model, what=self._what())
        if not version_ok:
            metrics["sync/ok"] = metrics["sync/verified"] = 0.0
        sink = self.trainer._metrics["train"]
        for name, value in {**metrics, "sync/push_seconds": pushed}.items():
            sink[name].append(float(value))

    def _judge_version(self) -> bool:
        """Whether the rollout worker reports the version the trainer just pushed (raises or warns otherwise)."""
        reported = getattr(self.trainer.rollout_worker, "model_version", None)
        version = int(self.trainer.model_version)
        if reported is not None and int(reported) == version:
            return True
        message = (f"{self._what()}: the rollout worker reports model version {reported} after the transfer of "
                   f"version {version}: its samples would carry the wrong version (and staleness)")
        if self.check.on_failure == "error":
            raise SyncCheckError(message)
        logger.warning(message)
        return False
