"""Every weight sync verified: after the trainer pushes its weights into the engine, the engine scores a few fixed
sequences (teacher-forced, temperature 1, no truncation) and the trainer scores the same tokens; the mean
|log p_engine − log p_trainer| over the probe's tokens is compared with the same gap measured once before any sync
(the run's own numerical mismatch: the engine's dtype, kernels, KV cache).

A sync that worked leaves the gap at that baseline (a bf16 vLLM engine against an fp32 trainer: ≈ 0.014 nats per
token on the lab model; fp32 against fp32: < 1e-5). A sync that silently did not — weights repacked and never
reloaded, a tied output head left at the old weights, a wrong dtype, a partial load — leaves the engine at other
weights, and the gap jumps: on the tiny model a tied head left behind gives 0.22 against a 2e-6 baseline. None of the
frameworks checks a sync; without a check such an engine looks like a large "mismatch" that every correction then
tries to correct.

The threshold is ``max(factor × baseline, floor)``; ``on_failure`` is ``"error"`` (raise :class:`SyncCheckError`,
naming the sync) or ``"warn"`` (log a warning and report ``sync/ok = 0`` in the metrics).

An engine takes part when it has ``score(prompt_ids, completion_ids) -> (logp [B, T], mask [B, T])`` under its own
numerics (:class:`~offpolicy.rollout.hf.HFRolloutEngine`, :class:`~offpolicy.rollout.vllm.VLLMRolloutEngine`, and
:class:`~offpolicy.rollout.servers.ServerRolloutEngine` on a vLLM server, via prompt log-probs).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

SYNC_CHECK_ACTIONS = ("error", "warn")


class SyncCheckError(RuntimeError):
    """The engine's log-probs after a weight sync are far from the trainer's: the sync did not take."""


@dataclass(frozen=True)
class SyncProbe:
    """Fixed sequences the engine and the trainer both score: ``prompt_ids[i] + completion_ids[i]``, the
    completion's tokens teacher-forced.

    >>> SyncProbe([[1, 5]], [[7, 8, 2]]).n_tokens
    3
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]

    def __post_init__(self) -> None:
        if not self.prompt_ids or len(self.prompt_ids) != len(self.completion_ids):
            raise ValueError(f"probe: prompt_ids ({len(self.prompt_ids)} rows) and completion_ids "
                             f"({len(self.completion_ids)} rows) must be non-empty and of equal length")
        if any(not p for p in self.prompt_ids) or any(not c for c in self.completion_ids):
            raise ValueError("probe: every row needs at least one prompt token and one completion token")

    @property
    def n_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)

    @classmethod
    def from_rollout(cls, prompt_ids: list[list[int]], completion_ids: list[list[int]], rows: int = 4) -> SyncProbe:
        """The first ``rows`` rows of a rollout that have at least one completion token.

        >>> SyncProbe.from_rollout([[1], [1, 2], [3]], [[], [4, 2], [5]], rows=4).prompt_ids
        [[1, 2], [3]]
        """
        keep = [(list(p), list(c)) for p, c in zip(prompt_ids, completion_ids) if len(c) > 0][:rows]
        if not keep:
            raise ValueError("probe: the rollout has no completion with at least one token")
        return cls([p for p, _ in keep], [c for _, c in keep])


def probe_gap(engine_logp: Tensor, trainer_logp: Tensor, mask: Tensor) -> float:
    """Mean |engine − trainer| log-prob over the probe's tokens (``[B, T]`` each; ``mask`` True for tokens).

    >>> probe_gap(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]]), torch.tensor([[True, True]]))
    0.25
    """
    if engine_logp.shape != trainer_logp.shape or engine_logp.shape != mask.shape:
        raise ValueError(f"probe_gap: engine_logp {tuple(engine_logp.shape)}, trainer_logp "
                         f"{tuple(trainer_logp.shape)} and mask {tuple(mask.shape)} must have one shape")
    if not bool(mask.any()):
        raise ValueError("probe_gap: mask has no token")
    diff = (engine_logp.float() - trainer_logp.float()).abs()[mask]
    if not bool(torch.isfinite(diff).all()):
        return math.inf  # a token one side gives probability 0: the two models certainly differ
    return float(diff.mean())


class SyncCheck:
    """Measures the engine–trainer gap on a :class:`SyncProbe` before any sync (:meth:`calibrate`) and after each
    (:meth:`after_sync`).

    Args:
        factor: a gap above ``factor × baseline`` fails.
        floor: ... unless it is below ``floor`` nats (an fp32 engine's baseline is round-off: 1e-6 × 4 would trip
            on noise).
        on_failure: ``"error"`` raises :class:`SyncCheckError`; ``"warn"`` logs and reports ``sync/ok = 0``.
    """

    def __init__(self, *, factor: float = 4.0, floor: float = 1e-3, on_failure: str = "error") -> None:
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1):
            raise ValueError(f"factor must be a finite number > 1, got {factor!r}")
        if not (isinstance(floor, (int, float)) and math.isfinite(floor) and floor >= 0):
            raise ValueError(f"floor must be a finite number >= 0, got {floor!r}")
        if on_failure not in SYNC_CHECK_ACTIONS:
            raise ValueError(f"on_failure must be one of {SYNC_CHECK_ACTIONS}, got {on_failure!r}")
        self.factor, self.floor, self.on_failure = float(factor), float(floor), on_failure
        self.probe: SyncProbe | None = None
        self.baseline: float | None = None

    @property
    def threshold(self) -> float:
        if self.baseline is None:
            raise ValueError("sync check: calibrate() before the first sync")
        return max(self.factor * self.baseline, self.floor)

    def judge(self, gap: float, *, what: str, seconds: float = 0.0) -> dict[str, float]:
        """The metrics of one measured ``gap`` after the sync named ``what``; raises or warns when it fails.

        >>> check = SyncCheck(factor=4.0, floor=1e-3)
        >>> check.baseline = 0.01
        >>> check.judge(0.02, what="step 3")["sync/ok"]
        1.0
        >>> check.judge(0.5, what="step 4")
        Traceback (most recent call last):
        ...
        offpolicy.rollout.sync_check.SyncCheckError: step 4: after the weight sync the engine's log-probs are 0.5 nats per token from the trainer's on the probe, 50× the 0.01 measured before any sync (threshold 0.04): the engine did not take the new weights
        """
        threshold = self.threshold
        ok = gap <= threshold
        metrics = {"sync/gap": gap, "sync/baseline": float(self.baseline or 0.0),
                   "sync/ratio": gap / self.baseline if self.baseline else (math.inf if gap > 0 else 1.0),
                   "sync/ok": float(ok), "sync/seconds": float(seconds)}
        if not ok:
            message = (f"{what}: after the weight sync the engine's log-probs are {gap:.3g} nats per token from the "
                       f"trainer's on the probe, {metrics['sync/ratio']:.3g}× the {self.baseline:.3g} measured before "
                       f"any sync (threshold {threshold:.3g}): the engine did not take the new weights")
            if self.on_failure == "error":
                raise SyncCheckError(message)
            logger.warning(message)
        return metrics

    def _gap(self, engine: Any, model: torch.nn.Module) -> float:
        from offpolicy.rollout.scoring import sequence_logprobs

        if self.probe is None:
            raise ValueError("sync check: no probe (set .probe or calibrate with one)")
        score = getattr(engine, "score", None)
        if score is None:
            raise ValueError(f"sync check: the engine {type(engine).__name__} cannot score given tokens (no score())")
        engine_logp, engine_mask = score(self.probe.prompt_ids, self.probe.completion_ids)[:2]
        with torch.no_grad():
            trainer_logp, mask = sequence_logprobs(model, self.probe.prompt_ids, self.probe.completion_ids)
        if not torch.equal(engine_mask.bool().cpu(), mask.cpu()):
            raise ValueError("sync check: the engine scored another set of tokens than the probe's")
        return probe_gap(engine_logp.cpu(), trainer_logp.cpu(), mask.cpu())

    def calibrate(self, engine: Any, model: torch.nn.Module, probe: SyncProbe | None = None) -> dict[str, float]:
        """Measure the baseline gap: call it while the engine holds the trainer's weights through another path than
        a sync (both loaded from the same checkpoint)."""
        if probe is not None:
            self.probe = probe
        start = time.perf_counter()
        self.baseline = self._gap(engine, model)
        if not math.isfinite(self.baseline):
            raise SyncCheckError("sync check: before any sync the engine gives probability 0 to a probe token the "
                                 "trainer does not: engine and trainer hold different models")
        return {"sync/baseline": self.baseline, "sync/seconds": time.perf_counter() - start}

    def after_sync(self, engine: Any, model: torch.nn.Module, *, what: str) -> dict[str, float]:
        """Score the probe on both sides after a sync and :meth:`judge` the gap."""
        start = time.perf_counter()
        gap = self._gap(engine, model)
        return self.judge(gap, what=what, seconds=time.perf_counter() - start)
