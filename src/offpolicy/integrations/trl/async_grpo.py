"""``OffPolicyAsyncGRPOTrainer``: TRL 1.16's asynchronous GRPO trainer (``trl.experimental.async_grpo``) with
offpolicy's corrections, objectives and mismatch metrics on its loss path, and each sample's policy version carried to
the loss, so that staleness is an input (the log-linear π_prox reads it) and a metric.

How TRL 1.16's ``AsyncGRPOTrainer`` is built, and where this plugs in:

* samples — the rollout worker (``AsyncRolloutWorker``, or one passed as ``rollout_worker=``) pushes
  ``RolloutSample``s (``input_ids``, ``completion_mask``, ``old_log_probs`` = μ, the engine's log-probs, one
  ``advantage``, ``model_version`` = the policy version the engine had) into a queue; ``RolloutQueueDataset`` drops
  samples more than ``max_staleness`` versions old and yields the others as dicts *without* ``model_version``;
  ``DataCollatorForRollout`` packs them into prefix-trie rows (``packing.TreeRow``): ``M`` flat loss terms with
  ``token_index`` (packed position), ``old_log_probs``, ``advantages`` and ``segment_id`` (the completion). Here the
  dataset also yields ``model_version`` and the collator adds the ``[num_processes, S]`` sample versions
  (:data:`VERSION_KEY`), both subclasses of TRL's, put in place only while TRL's ``get_train_dataloader`` builds the
  pipeline (:func:`versioned_pipeline`, restored after).
* the loss — TRL's ``compute_loss`` runs the fused-head forward and computes PPO-clip on r = π_θ/μ inline (no π_old
  forward: μ is the anchor), summed and divided by the micro-batch's tokens per rank and the accumulation steps. The
  override here runs the same forward, lays the terms out as ``[S, T]`` rows (one per completion,
  :func:`~offpolicy.integrations.trl.staleness.rows_from_packed`) and calls :func:`offpolicy.policy_loss` with the
  correction; with neither ``correction=`` nor ``objective=`` it is TRL's loss (``bypass``, r = π_θ/μ, TRL's
  ``epsilon`` / ``epsilon_high``, TRL's normaliser).
* weight transfer and versions — every ``weight_sync_steps`` optimizer steps ``_sync_weight`` streams the weights
  (``weight_transfer=``: NCCL into vLLM by default; without CUDA
  :class:`~offpolicy.integrations.trl.async_sync.FileWeightTransfer`, a reload folder vLLM reloads) and bumps ``model_version`` (rank 0's); the worker is told the new
  version; then the sync check (``sync_check=``, :mod:`~offpolicy.integrations.trl.async_check`) verifies the version
  the worker reports and the weights the engine holds. A sample's staleness is d = v_θ − v_sample at the loss, in weight syncs (per optimizer step when
  ``weight_sync_steps=1``). TRL's own ``sample/staleness_*`` is taken when the sample leaves the queue, and the
  dataloader (accelerate's dispatcher) draws the next micro-batch before the step's sync: one version earlier.
* the rollout worker is untouched: any ``RolloutWorkerProtocol`` whose samples carry ``model_version`` works.

The arguments (the same names as :class:`~offpolicy.integrations.trl.OffPolicyGRPOTrainer`'s):

* ``correction=`` — a registered name, spec, list or :class:`~offpolicy.Correction`. The async trainer trains each
  sample once, so π_old = sg(π_θ) and the correction's ratio is π_θ/μ: staleness and engine numerics together. With
  a correction the default objective is ``ppo`` (r = 1: the correction carries the whole π_θ/μ weight); ``bypass``
  with a correction is refused (its ratio is already π_θ/μ: the mismatch would be weighted twice).
* ``objective=`` — any registered objective; ``{"name": "decoupled", "proximal": "loglinear"}`` is AReaL's decoupled
  PPO with π_prox = μ + α(sg π_θ − μ), α = (d − 1)/d from each token's staleness (arXiv 2110.00641 eq. 5 with
  AReaL's log-linear π_prox, :mod:`offpolicy.objectives.proximal`): PPO clips π_θ/π_prox, the correction weighs
  π_prox/μ.
* ``aggregation=`` — a registered aggregation (then divided by the accumulation steps only); default TRL's
  (``token_sum`` / tokens per rank).
* ``clip_low=``, ``clip_high=``, ``dual_clip=`` — override TRL's ``epsilon`` / ``epsilon_high``.
* ``metric_naming=`` — the mismatch metrics' names (``"trl"``: ``sampling/…``).
* ``sync_check=`` — every weight transfer verified (:mod:`~offpolicy.integrations.trl.async_check`), with
  ``OffPolicyGRPOTrainer``'s values: ``"error"`` (default: a transfer after which the engine reports another version
  or its log-probs on a fixed probe are far from the trainer's raises ``SyncCheckError`` naming the step, the version
  and the metric or tensor), ``"warn"`` (logged, ``sync/ok`` = 0), a ``SyncCheck``, or ``"off"`` / None. The engine
  scored is the rollout worker when it has ``score()``, else TRL's ``AsyncRolloutWorker``'s vLLM server.

Logged: TRL's ``sample/…``, ``batch/…`` and ``perf/…`` metrics as before; in place of its loss metrics (``ratio``,
``kl``, ``clip_ratio/…``), ``offpolicy/loss/…`` and the correction's metrics, the mismatch π_old vs μ under
``metric_naming`` (π_old = sg π_θ, so ``sampling/k3_kl`` is TRL's ``kl``; π_prox under loglinear), ``entropy``, and ``offpolicy/staleness/mean``, ``/max`` and
per staleness d ``offpolicy/staleness/d<d>/k3_kl``, ``/clipped_frac``, ``/masked_frac``, ``/tokens``
(:func:`~offpolicy.metrics.metrics_by_staleness`). They are each rank's own micro-batch (TRL
all-reduces its loss metrics; these are not), logged from rank 0.

TRL's ``AsyncRolloutWorker`` tags a group with the version at its first request; a request still running across a
weight sync finishes on the newer weights, so for its later tokens d is an upper bound.

TRL 1.16 only (:func:`check_async_trl`): the async trainer is experimental and TRL 1.18 moves it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from offpolicy.integrations.versions import VERSIONS, installed_version


def check_async_trl(version: str | None = None) -> None:
    """Refuse a TRL other than 1.16 (``version``: the installed one by default), in one line naming it."""
    version = installed_version("trl") if version is None else version
    if version is None:
        raise ImportError("OffPolicyAsyncGRPOTrainer needs TRL 1.16: pip install 'offpolicy[trl]'")
    if not VERSIONS["trl"].supports(version):
        raise RuntimeError(f"trl: OffPolicyAsyncGRPOTrainer plugs into TRL 1.16's trl.experimental.async_grpo, but "
                           f"TRL {version} is installed (later releases move the async trainer); install trl 1.16")


check_async_trl()

import torch  # noqa: E402 - after the version gate: the imports below need TRL 1.16
from accelerate.utils import broadcast_object_list  # noqa: E402
from torch import Tensor  # noqa: E402
from trl.experimental.async_grpo import AsyncGRPOTrainer  # noqa: E402
from trl.experimental.async_grpo import async_grpo_trainer as _trl_async  # noqa: E402
from trl.trainer.utils import pad  # noqa: E402

from offpolicy.batch import LogProbBatch  # noqa: E402
from offpolicy.corrections.base import Correction  # noqa: E402
from offpolicy.integrations.trl.async_check import AsyncTransferCheck  # noqa: E402
from offpolicy.integrations.trl.loss import trl_objective  # noqa: E402
from offpolicy.integrations.trl.staleness import rows_from_packed, token_staleness  # noqa: E402
from offpolicy.integrations.trl.vllm_sync import check_sync_setting  # noqa: E402
from offpolicy.losses import policy_loss  # noqa: E402
from offpolicy.metrics import (  # noqa: E402
    check_naming,
    metrics_by_staleness,  # noqa: E402
    offpolicy_metrics,
)
from offpolicy.objectives.proximal import approximate_proximal  # noqa: E402
from offpolicy.registry import AGGREGATIONS, CorrectionSpec, build_correction  # noqa: E402
from offpolicy.rollout.sync_check import SyncCheck  # noqa: E402

__all__ = ["VERSION_KEY", "OffPolicyAsyncGRPOTrainer", "VersionedCollator", "VersionedRolloutQueueDataset",
           "check_async_trl", "versioned_pipeline"]

VERSION_KEY = "offpolicy_sample_version"  # [num_processes, S] int64: each packed sample's model_version, −1 padding


class _RecordingQueue:
    """The rollout queue, remembering the last sample ``get`` returned (TRL's dataset keeps only some fields)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.last: Any = None

    def get(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._inner.get(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class VersionedRolloutQueueDataset(_trl_async.RolloutQueueDataset):
    """TRL's ``RolloutQueueDataset`` whose items also carry ``model_version``. TRL's ``__iter__`` yields each item
    right after the ``get`` that returned its sample (a stale one is dropped and the next fetched first), so the
    queue's last sample at a yield is that item's."""

    def __init__(self, rollout_queue: Any, **kwargs: Any) -> None:
        super().__init__(rollout_queue=_RecordingQueue(rollout_queue), **kwargs)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for item in super().__iter__():
            yield {**item, "model_version": int(self.queue.last.model_version)}


@dataclass
class VersionedCollator(_trl_async.DataCollatorForRollout):
    """TRL's ``DataCollatorForRollout`` plus :data:`VERSION_KEY`: row r's samples' ``model_version`` in the order of
    the row's ``segment_id`` (``TreeRow.samples``), rows padded with −1."""

    def torch_call(self, examples: list[Any]) -> dict[str, Any]:
        batch = super().torch_call(examples)
        (rows,) = examples
        versions = [torch.tensor([int(s["model_version"]) for s in row.samples], dtype=torch.long) for row in rows]
        batch[VERSION_KEY] = pad(versions, padding_value=-1)
        return batch


@contextlib.contextmanager
def versioned_pipeline() -> Iterator[None]:
    """Within the block, TRL's ``get_train_dataloader`` builds :class:`VersionedRolloutQueueDataset` and
    :class:`VersionedCollator`; TRL's classes are put back after (nothing stays changed)."""
    ours = {"RolloutQueueDataset": VersionedRolloutQueueDataset, "DataCollatorForRollout": VersionedCollator}
    saved = {name: getattr(_trl_async, name) for name in ours}
    for name, cls in ours.items():
        setattr(_trl_async, name, cls)
    try:
        yield
    finally:
        for name, cls in saved.items():
            setattr(_trl_async, name, cls)


class OffPolicyAsyncGRPOTrainer(AsyncGRPOTrainer):
    """TRL 1.16's ``AsyncGRPOTrainer`` with :func:`offpolicy.policy_loss` on its loss path (see the module
    docstring): ``correction=``, ``objective=``, ``aggregation=``, ``clip_low=``, ``clip_high=``, ``dual_clip=``,
    ``metric_naming=``, ``sync_check=``, then everything ``AsyncGRPOTrainer`` takes."""

    def __init__(
        self,
        *args: Any,
        correction: Correction | CorrectionSpec | list[CorrectionSpec] | None = None,
        objective: str | dict[str, Any] | None = None,
        aggregation: str | None = None,
        clip_low: float | None = None,
        clip_high: float | None = None,
        dual_clip: float | None = None,
        metric_naming: str = "trl",
        sync_check: str | SyncCheck | None = "error",
        **kwargs: Any,
    ) -> None:
        check_naming(metric_naming)
        check = check_sync_setting(sync_check)  # refused before TRL builds anything
        correction = correction if isinstance(correction, Correction) else build_correction(correction)
        if aggregation is not None and aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {sorted(AGGREGATIONS)}, got {aggregation!r}")
        super().__init__(*args, **kwargs)
        bind = getattr(getattr(self, "weight_transfer", None), "bind", None)
        if callable(bind):  # FileWeightTransfer: the tied names TRL's named_parameters stream leaves out
            bind(self.accelerator.unwrap_model(self.model))
        self.offpolicy_sync = AsyncTransferCheck(self, check) if check is not None else None
        default = "bypass" if correction is None else "ppo"  # TRL's own loss; with a correction r = 1, see above
        name, params = trl_objective(self.args, default if objective is None else objective)
        if correction is not None and name == "bypass":
            raise ValueError("correction= with objective='bypass': bypass's ratio is already π_θ/μ, so the "
                             "correction would weight the mismatch twice; use objective='ppo' (the default with a "
                             "correction) or {'name': 'decoupled', 'proximal': 'loglinear'}")
        explicit = {"clip_low": clip_low, "clip_high": clip_high, "dual_clip": dual_clip}
        params.update({k: v for k, v in explicit.items() if v is not None})
        self.offpolicy_correction = correction
        self.offpolicy_metric_naming = metric_naming
        self._offpolicy_trls_norm = aggregation is None
        self._offpolicy_loglinear = params.get("proximal") == "loglinear"
        self.offpolicy_loss_kwargs: dict[str, Any] = {"objective": {"name": name, **params},
                                                      "aggregation": aggregation or "token_sum"}

    # -- the weight transfer, checked --------------------------------------------------------------------------
    def _sync_weight(self) -> None:
        """TRL's transfer (the cold one at ``train()``'s start, then every ``weight_sync_steps``), then the sync
        check on the version the worker reports and the weights the engine holds (:mod:`.async_check`)."""
        if self.offpolicy_sync is None:
            super()._sync_weight()
        else:
            self.offpolicy_sync(super()._sync_weight)

    # -- the samples' versions ---------------------------------------------------------------------------------
    def get_train_dataloader(self) -> Any:
        with versioned_pipeline():
            return super().get_train_dataloader()

    def _policy_version(self) -> int:
        """v_θ: rank 0's ``model_version`` (TRL bumps it on rank 0 only), broadcast when there are several ranks."""
        if self.accelerator.num_processes == 1:
            return int(self.model_version)
        return int(broadcast_object_list([self.model_version], from_process=0)[0])

    # -- the loss ----------------------------------------------------------------------------------------------
    def _packed_forward(self, model: Any, inputs: dict[str, Any]) -> tuple[Tensor, Tensor, Any]:
        """TRL 1.16's forward of ``compute_loss``: ``(log_probs [M], entropy [M], outputs)`` of the selected terms."""
        mask_bool = inputs["attention_mask"].bool()
        selected = inputs["token_index"] >= 0
        token_index = inputs["token_index"][selected]
        tree_kwargs = {key: inputs[key][inputs[key] >= 0]
                       for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
        tree_kwargs["tree_max_seqlen_q"], tree_kwargs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
        router_kwargs = {"output_router_logits": True} if self.aux_loss_enabled else {}
        start = time.time()
        outputs = model(input_ids=inputs["input_ids"][mask_bool].unsqueeze(0),
                        position_ids=inputs["position_ids"][mask_bool].unsqueeze(0),
                        shift_labels=inputs["shift_labels"][mask_bool].unsqueeze(0),
                        fused_lm_head=True, **router_kwargs, **tree_kwargs)
        self._last_forward_time_s = time.time() - start
        return outputs.log_probs.flatten()[token_index], outputs.entropy.flatten()[token_index], outputs

    def offpolicy_batch(self, inputs: dict[str, Any], log_probs: Tensor) -> tuple[LogProbBatch, Tensor]:
        """``(batch, staleness [S, T])``: this rank's flat terms (``log_probs`` [M] = π_θ) as ``[S, T]`` rows, one per
        completion: μ = TRL's ``old_log_probs``, each token's ``versions`` and v_θ (what the log-linear π_prox reads);
        staleness −1 off the mask."""
        selected = inputs["token_index"] >= 0
        segment_id = inputs["segment_id"][selected]
        if VERSION_KEY not in inputs:
            raise ValueError(f"inputs is missing {VERSION_KEY!r}: build the dataloader with "
                             "OffPolicyAsyncGRPOTrainer.get_train_dataloader (versioned_pipeline)")
        version = self._policy_version()
        staleness = token_staleness(inputs[VERSION_KEY][0], segment_id, version)
        mask, logp, mu, adv, stale = rows_from_packed(segment_id, log_probs, inputs["old_log_probs"][selected].float(),
                                                      inputs["advantages"][selected].float(), staleness)
        on = mask.bool()
        stale = torch.where(on, stale, -1)
        batch = LogProbBatch(logp=logp, mask=mask, rollout_logp=mu, advantages=adv,
                             versions=torch.where(on, version - stale, -1), policy_version=version)
        return batch, stale

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Tensor:
        """TRL's ``compute_loss`` with :func:`offpolicy.policy_loss` in place of its inline PPO-clip on π_θ/μ."""
        if return_outputs:
            raise ValueError("return_outputs: the async GRPO loss has no model outputs to return")
        log_probs, entropy, outputs = self._packed_forward(model, inputs)
        batch, stale = self.offpolicy_batch(inputs, log_probs)
        if self._offpolicy_loglinear:  # π_prox once, so the correction and its metrics read the same π_old as the loss
            batch = approximate_proximal(batch)
        correction = self.offpolicy_correction
        result = correction(batch) if correction is not None else None
        loss, metrics = policy_loss(batch, correction=result, **self.offpolicy_loss_kwargs)
        global_n_tokens = inputs["global_n_tokens"][0]
        if self._offpolicy_trls_norm:  # TRL: Σ over this rank's terms / (the micro-batch's terms per rank)
            loss = loss / (global_n_tokens / self.accelerator.num_processes).clamp(min=1.0).float()
        loss = loss / self.current_gradient_accumulation_steps
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / self.current_gradient_accumulation_steps
        self._offpolicy_log(batch, stale, entropy, result, metrics)
        self._account(inputs, global_n_tokens)
        return loss

    def _offpolicy_log(self, batch: LogProbBatch, stale: Tensor, entropy: Tensor, result: Any,
                       metrics: dict[str, Tensor]) -> None:
        sink = self._metrics["train"]
        pi, mu = batch.logp.detach(), batch.rollout_logp
        assert mu is not None  # offpolicy_batch sets μ
        old = batch.old_logp if batch.old_logp is not None else pi
        for name, value in metrics.items():
            sink[f"offpolicy/{name}"].append(float(value))
        # the diagnostics compare π_old (sg π_θ, or π_prox under loglinear) with μ, as the correction does
        for name, value in offpolicy_metrics(old, mu, batch.mask, result,
                                             naming=self.offpolicy_metric_naming).items():
            sink[name].append(float(value))
        for name, value in metrics_by_staleness(stale, pi, mu, batch.mask, result, old).items():
            sink[f"offpolicy/{name}"].append(float(value))
        sink["entropy"].append(float(entropy.detach().float().mean()) if entropy.numel() else 0.0)

    def _account(self, inputs: dict[str, Any], global_n_tokens: Tensor) -> None:
        """TRL's per-step accounting, flushed by its ``_log_step_metrics``."""
        n_forward = float(inputs["global_n_forward_tokens"][0])
        mean_seq_len = float(inputs["mean_seq_len"][0])
        self._step_forward_tokens += n_forward
        self._step_trained_tokens += float(global_n_tokens)
        self._step_seq_len_weighted += mean_seq_len * n_forward
        self._step_samples += n_forward / mean_seq_len
        self._step_forward_s += self._last_forward_time_s
