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

Two tests, either of which fails a sync:

* the gap — above ``max(factor × baseline, floor)``;
* the staleness — the probe's log-probs under the previous sync's weights are kept, and the engine's residual is
  projected on the step the trainer took since: β = Σ (e − n)(o − n) / Σ (o − n)² (e the engine, n and o the trainer
  under the new and the previous weights) is 0 when the engine took the new weights (its residual is numerical
  noise, unrelated to the step) and 1 when it kept the old ones, in between for a partial sync (a head left behind).
  β > 0.5 fails when it is resolved: when the step moved the probe's log-probs (root mean square of o − n) at least
  twice as much as the numerical noise does (the residual's root mean square at the baseline). Then |β| ≤ ½ for
  any residual that is noise alone, and a sync that did not happen at all gives β ≈ 1 after a single update, before
  the gap alone grows past bf16's noise. (The noise is not independent of the step — on the tiny model in bf16 β
  sat at −0.04 to −0.07 over healthy syncs — so β's spread is not the noise's over √n.) A partial sync that leaves
  a small part behind moves β little; the gap catches it once it has drifted past ``factor`` × the baseline.

 ``on_failure`` is ``"error"`` (raise :class:`SyncCheckError`,
naming the sync) or ``"warn"`` (log a warning and report ``sync/ok = 0`` in the metrics). The baseline is measured
while engine and trainer hold the same weights — both loaded from one checkpoint, or right after the first sync of a
fresh run, before any update (the reference trainer does the latter, on the first rollout's first rows) — and must
itself stay below ``max_baseline`` (0.05 nats per token, 3.5× vLLM bf16's gap on the lab model): a larger one means
the two sides hold different models (another checkpoint, tokenizer or dtype than intended), and that is an error
too.

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


class SyncCheckError(ValueError):
    """The engine's log-probs after a weight sync are far from the trainer's: the sync did not take (a ValueError,
    so that the CLI reports it in one line like any other bad state of the run's inputs)."""


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
    def from_rollout(cls, prompt_ids: list[list[int]], completion_ids: list[list[int]], rows: int = 16) -> SyncProbe:
        """The first ``rows`` rows of a rollout that have at least one completion token.

        >>> SyncProbe.from_rollout([[1], [1, 2], [3]], [[], [4, 2], [5]], rows=4).prompt_ids
        [[1, 2], [3]]
        """
        keep = [(list(p), list(c)) for p, c in zip(prompt_ids, completion_ids) if len(c) > 0][:rows]
        if not keep:
            raise ValueError("probe: the rollout has no completion with at least one token")
        return cls([p for p, _ in keep], [c for _, c in keep])


def stale_fraction(engine_logp: Tensor, new_logp: Tensor, old_logp: Tensor, mask: Tensor) -> tuple[float, float]:
    """β = Σ (e − n)(o − n) / Σ (o − n)² over the probe's tokens, and the step's root mean square
    √(mean (o − n)²) (all ``[B, T]``; see the module docstring). β is NaN when the weights did not move.

    >>> e, n, o = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.2, -2.4]]), torch.tensor([[-1.0, -2.0]])
    >>> beta, step_rms = stale_fraction(e, n, o, torch.tensor([[True, True]]))
    >>> round(beta, 6), round(step_rms, 4)  # the engine is at the old weights: (0.2·0.2 + 0.4·0.4) / (0.04 + 0.16)
    (1.0, 0.3162)
    """
    step = (old_logp.float() - new_logp.float())[mask]
    residual = (engine_logp.float() - new_logp.float())[mask]
    norm2 = float((step * step).sum())
    if norm2 == 0.0:
        return math.nan, 0.0
    return float((residual * step).sum()) / norm2, math.sqrt(norm2 / step.numel())


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
    """Measures the engine–trainer gap on a :class:`SyncProbe` once with the same weights on both sides
    (:meth:`calibrate`) and after every sync (:meth:`after_sync`).

    Args:
        factor: a gap above ``factor × baseline`` fails.
        floor: ... unless it is below ``floor`` nats (an fp32 engine's baseline is round-off: 1e-6 × 4 would trip
            on noise).
        max_baseline: a baseline above this many nats per token raises (the two sides hold different models).
        max_stale: a resolved staleness β above this fails (see the module docstring).
        on_failure: ``"error"`` raises :class:`SyncCheckError`; ``"warn"`` logs and reports ``sync/ok = 0``.
    """

    STALE_RESOLUTION = 2.0  # β counts once the step moves the probe this many times more than the noise does

    def __init__(self, *, factor: float = 4.0, floor: float = 1e-3, max_baseline: float = 0.05,
                 max_stale: float = 0.5, on_failure: str = "error") -> None:
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1):
            raise ValueError(f"factor must be a finite number > 1, got {factor!r}")
        if not (isinstance(floor, (int, float)) and math.isfinite(floor) and floor >= 0):
            raise ValueError(f"floor must be a finite number >= 0, got {floor!r}")
        if not (isinstance(max_baseline, (int, float)) and max_baseline > 0):
            raise ValueError(f"max_baseline must be a number > 0, got {max_baseline!r}")
        if not (isinstance(max_stale, (int, float)) and 0 < max_stale < 1):
            raise ValueError(f"max_stale must be in (0, 1), got {max_stale!r}")
        if on_failure not in SYNC_CHECK_ACTIONS:
            raise ValueError(f"on_failure must be one of {SYNC_CHECK_ACTIONS}, got {on_failure!r}")
        self.factor, self.floor, self.on_failure = float(factor), float(floor), on_failure
        self.max_baseline, self.max_stale = float(max_baseline), float(max_stale)
        self.probe: SyncProbe | None = None
        self.baseline: float | None = None
        self.noise_rms = 0.0  # root mean square of the engine − trainer residual at the baseline
        self._trainer_logp: Tensor | None = None  # the probe under the last checked weights

    @property
    def threshold(self) -> float:
        if self.baseline is None:
            raise ValueError("sync check: calibrate() before the first sync")
        return max(self.factor * self.baseline, self.floor)

    def judge(self, gap: float, *, what: str, seconds: float = 0.0, stale: float = math.nan,
              step_rms: float = 0.0) -> dict[str, float]:
        """The metrics of one sync named ``what`` from its ``gap`` and staleness β over a step of ``step_rms``;
        raises or warns when it fails.

        >>> check = SyncCheck(factor=4.0, floor=1e-3)
        >>> check.baseline, check.noise_rms = 0.01, 0.012
        >>> check.judge(0.02, what="step 3", stale=0.1, step_rms=0.05)["sync/ok"]
        1.0
        >>> check.judge(0.5, what="step 4")
        Traceback (most recent call last):
        ...
        offpolicy.rollout.sync_check.SyncCheckError: step 4: after the weight sync the engine's log-probs are 0.5 nats per token from the trainer's on the probe, 50× the 0.01 measured with the same weights on both sides (threshold 0.04): the engine did not take the new weights
        >>> check.judge(0.02, what="step 5", stale=0.8, step_rms=0.005)["sync/ok"]  # a step within the noise: no verdict
        1.0
        >>> check.judge(0.02, what="step 6", stale=0.8, step_rms=0.05)
        Traceback (most recent call last):
        ...
        offpolicy.rollout.sync_check.SyncCheckError: step 6: after the weight sync the engine is 0.8 of the way back to the previous weights on the probe (0: it took the new ones, 1: it kept the old; threshold 0.5): the engine did not take all of the new weights
        """
        threshold = self.threshold
        resolved = math.isfinite(stale) and step_rms >= self.STALE_RESOLUTION * self.noise_rms
        metrics = {"sync/gap": gap, "sync/baseline": float(self.baseline or 0.0),
                   "sync/ratio": gap / self.baseline if self.baseline else (math.inf if gap > 0 else 1.0),
                   "sync/stale_fraction": stale, "sync/step_rms": step_rms, "sync/seconds": float(seconds)}
        message = None
        if not gap <= threshold:
            message = (f"{what}: after the weight sync the engine's log-probs are {gap:.3g} nats per token from the "
                       f"trainer's on the probe, {metrics['sync/ratio']:.3g}× the {self.baseline:.3g} measured with "
                       f"the same weights on both sides (threshold {threshold:.3g}): the engine did not take the new "
                       "weights")
        elif resolved and stale > self.max_stale:
            message = (f"{what}: after the weight sync the engine is {stale:.3g} of the way back to "
                       f"the previous weights on the probe (0: it took the new ones, 1: it kept the old; threshold "
                       f"{self.max_stale:g}): the engine did not take all of the new weights")
        metrics["sync/ok"] = float(message is None)
        if message is not None:
            if self.on_failure == "error":
                raise SyncCheckError(message)
            logger.warning(message)
        return metrics

    def _score(self, engine: Any, model: torch.nn.Module) -> tuple[Tensor, Tensor, Tensor]:
        """The probe's log-probs under the engine and under the trainer, and the mask (CPU tensors)."""
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
        return engine_logp.float().cpu(), trainer_logp.float().cpu(), mask.cpu()

    def calibrate(self, engine: Any, model: torch.nn.Module, probe: SyncProbe | None = None) -> dict[str, float]:
        """Measure the baseline gap while the engine holds the trainer's weights (both loaded from one checkpoint,
        or right after the first sync, before any update)."""
        if probe is not None:
            self.probe = probe
        start = time.perf_counter()
        engine_logp, trainer_logp, mask = self._score(engine, model)
        baseline = probe_gap(engine_logp, trainer_logp, mask)
        if not baseline <= self.max_baseline:  # NaN and inf included
            raise SyncCheckError(f"sync check: with the same weights on both sides the engine's log-probs are "
                                 f"{baseline:.3g} nats per token from the trainer's on the probe (more than "
                                 f"max_baseline {self.max_baseline:g}): engine and trainer hold different models "
                                 "(checkpoint, tokenizer or dtype)")
        self.baseline = baseline
        self.noise_rms = float(((engine_logp - trainer_logp)[mask] ** 2).mean().sqrt())
        self._trainer_logp = trainer_logp
        return {"sync/gap": baseline, "sync/baseline": baseline, "sync/ratio": 1.0, "sync/ok": 1.0,
                "sync/seconds": time.perf_counter() - start}

    def after_sync(self, engine: Any, model: torch.nn.Module, *, what: str) -> dict[str, float]:
        """Score the probe on both sides after a sync and :meth:`judge` its gap and staleness."""
        start = time.perf_counter()
        engine_logp, trainer_logp, mask = self._score(engine, model)
        stale, step_rms = math.nan, 0.0
        if self._trainer_logp is not None:
            stale, step_rms = stale_fraction(engine_logp, trainer_logp, self._trainer_logp, mask)
        self._trainer_logp = trainer_logp
        return self.judge(probe_gap(engine_logp, trainer_logp, mask), what=what, stale=stale, step_rms=step_rms,
                          seconds=time.perf_counter() - start)
