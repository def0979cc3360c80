"""Closed-loop control of the correction thresholds and the learning rate, from the mismatch a run measures.

Static thresholds are copied between setups that differ by orders of magnitude in mismatch: TRM's paper defaults
(max token KL 0.05, mean 0.001, arXiv 2512.23075 §5) reject every sequence of an int4-weight engine, and a fixed MIS
band masks nothing on one engine and half the batch on another. Each controller here reads what the current step
measured and sets the value the *next* step uses (causal: a step is never judged by a threshold fitted to itself).

* :class:`AcceptanceController` — a rejection threshold (TRM's δ, the veto's τ, …) relaxed just enough that a
  target fraction of the recent window would have been accepted, never stricter than the configured threshold:
  δ_{k+1} = max(δ₀, Q_target(window of per-sequence statistics)). With a small mismatch it is the paper's test; with
  a large one it stops the test from silently rejecting everything (TRM's "monitor acceptance, keep ≥ 70 %").
* :class:`RatioBandController` — an IS band [L, U] widened to running quantiles of the token ratio π_old/μ so that
  at most ``max_masked`` of the tokens fall outside it; never narrower than the configured band.
* :class:`LRGuard` — the learning-rate view of the mismatch (Zhang & Li, "Beyond precision: why training–inference
  mismatch is an optimization problem"): when the mismatch trend rises — the least-squares slope of log k3-KL over a
  window says it grows by more than ``rise`` (a factor) across the window — the learning rate is cut by ``factor``;
  after ``patience`` steps without a rise it recovers by 1/``factor`` towards its base value.

All three are deterministic functions of the metrics they are fed, keep their state as plain floats/lists
(``state_dict`` / ``load_state_dict``, stored in checkpoints so a resumed run continues the same trajectory) and
never touch a tensor that needs a gradient.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor


def _values(x: Tensor, mask: Tensor | None) -> list[float]:
    """The finite entries of ``x`` (at ``mask``), as Python floats (the controllers' window is host-side state)."""
    x = x.detach().double()
    if mask is not None:
        x = x[mask.bool()]
    return x[torch.isfinite(x)].flatten().tolist()


def _quantile(values: list[float], q: float, side: str = "higher") -> float:
    """The q-quantile of ``values`` taken at an order statistic, not interpolated: ``side="higher"`` rounds the
    position q·(n − 1) up, so that at most a fraction 1 − q of the values lies strictly above it (``"lower"``: rounds
    down, at most q strictly below) — a threshold fitted to a window then keeps its promise on that window."""
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q, interpolation=side))


@dataclass
class AcceptanceController:
    """Rejection threshold for a per-sequence statistic s (reject iff s > δ), relaxed to keep ``target`` accepted.

    ``update(stats)`` takes this step's per-sequence statistics (e.g. max_t KL per sequence, ``[B]``; non-finite
    entries — sequences with no valid token — are ignored) and returns the threshold for the next step:
    δ = max(``floor``, Q_target(last ``window`` steps' statistics)), Q an order statistic so that at least ``target``
    of the window is accepted. Before the first update it is ``floor``.

    >>> c = AcceptanceController(floor=0.05, target=0.7, window=1)
    >>> c.threshold
    0.05
    >>> c.update(torch.tensor([0.01, 0.02, 0.03, 0.04]))  # all below the floor: the paper's δ stays
    0.05
    >>> round(c.update(torch.tensor([0.1, 0.2, 0.3, 0.4])), 6)  # Q_0.7: position 0.7·3 = 2.1, rounded up → 4th
    0.4
    """

    floor: float
    target: float = 0.7
    window: int = 5
    threshold: float = field(init=False)
    _history: deque = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.floor) and self.floor > 0):
            raise ValueError(f"floor must be a finite float > 0, got {self.floor!r}")
        if not 0.0 < self.target < 1.0:
            raise ValueError(f"target must be in (0, 1), got {self.target!r}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window!r}")
        self.threshold = self.floor
        self._history = deque(maxlen=self.window)

    def update(self, stats: Tensor, mask: Tensor | None = None) -> float:
        self._history.append(_values(stats, mask))
        pooled = [v for step in self._history for v in step]
        self.threshold = max(self.floor, _quantile(pooled, self.target)) if pooled else self.threshold
        return self.threshold

    def state_dict(self) -> dict:
        return {"threshold": self.threshold, "history": [list(h) for h in self._history]}

    def load_state_dict(self, state: dict) -> None:
        self.threshold = float(state["threshold"])
        self._history = deque((list(h) for h in state["history"]), maxlen=self.window)


@dataclass
class RatioBandController:
    """IS band [L, U] on the token ratio ρ = π_old/μ, widened so that at most ``max_masked`` of the recent tokens fall
    outside it: U = max(``upper``, Q_{1−m/2}(ρ)), L = min(``lower``, Q_{m/2}(ρ)) (order-statistic quantiles) over the last ``window`` steps
    (one-sided — only U — when ``lower`` is None). Before the first update it is the configured band.

    ``update(log_ratio, mask)`` takes this step's log ρ ``[B, T]`` and the valid-token mask.

    >>> c = RatioBandController(lower=None, upper=2.0, max_masked=0.5, window=1)
    >>> band = c.update(torch.log(torch.tensor([[1.0, 2.0, 4.0, 8.0]])), torch.ones(1, 4))
    >>> band[0], round(band[1], 4)  # Q_0.5 of log₂ρ = (0, 1, 2, 3): position 1.5, rounded up → 2: U = 2² = 4 > 2
    (None, 4.0)
    """

    lower: float | None = None
    upper: float = 2.0
    max_masked: float = 0.05
    window: int = 5
    band: tuple[float | None, float] = field(init=False)
    _history: deque = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.upper) and self.upper > 0):
            raise ValueError(f"upper must be a finite float > 0, got {self.upper!r}")
        if self.lower is not None and not (0 <= self.lower < self.upper):
            raise ValueError(f"lower must be None or in [0, upper), got {self.lower!r}")
        if not 0.0 < self.max_masked < 1.0:
            raise ValueError(f"max_masked must be in (0, 1), got {self.max_masked!r}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window!r}")
        self.band = (self.lower, self.upper)
        self._history = deque(maxlen=self.window)

    def update(self, log_ratio: Tensor, mask: Tensor) -> tuple[float | None, float]:
        self._history.append(_values(log_ratio, mask))
        pooled = [v for step in self._history for v in step]
        if not pooled:
            return self.band
        tail = self.max_masked if self.lower is None else self.max_masked / 2
        upper = max(self.upper, math.exp(_quantile(pooled, 1.0 - tail)))
        lower = None if self.lower is None else min(self.lower, math.exp(_quantile(pooled, tail, side="lower")))
        self.band = (lower, upper)
        return self.band

    def state_dict(self) -> dict:
        return {"band": list(self.band), "history": [list(h) for h in self._history]}

    def load_state_dict(self, state: dict) -> None:
        self.band = (state["band"][0], float(state["band"][1]))
        self._history = deque((list(h) for h in state["history"]), maxlen=self.window)


@dataclass
class LRGuard:
    """Learning-rate multiplier from the trend of the mismatch (log k3-KL per step).

    Each ``update(k3_kl)`` appends log(k3) to a window of the last ``window`` steps; once the window is full, the
    least-squares slope b of log k3 against the step gives the rise across the window, exp(b·(window − 1)). If it is
    above ``rise``, the multiplier is cut by ``factor`` (not below ``min_scale``) and the window restarts (the next cut
    needs a new full window of evidence); after ``patience`` consecutive updates without a cut, the multiplier
    recovers by 1/``factor`` (not above 1). Returns the multiplier for the next step's learning rate.

    >>> g = LRGuard(window=3, rise=2.0, factor=0.5, patience=100)
    >>> [g.update(k) for k in (1e-4, 1e-4, 1e-4)]   # flat: no cut
    [1.0, 1.0, 1.0]
    >>> g = LRGuard(window=3, rise=2.0, factor=0.5, patience=100)
    >>> [g.update(k) for k in (1e-4, 2e-4, 4e-4)]   # log k3 rises by log 4 over two steps: 4 > 2, cut once
    [1.0, 1.0, 0.5]
    """

    window: int = 20
    rise: float = 2.0
    factor: float = 0.5
    min_scale: float = 0.05
    patience: int = 50
    scale: float = field(init=False, default=1.0)
    _logs: deque = field(init=False, repr=False)
    _calm: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"window must be >= 2, got {self.window!r}")
        if not self.rise > 1.0:
            raise ValueError(f"rise must be > 1 (a growth factor across the window), got {self.rise!r}")
        if not 0.0 < self.factor < 1.0:
            raise ValueError(f"factor must be in (0, 1), got {self.factor!r}")
        if not 0.0 < self.min_scale <= 1.0:
            raise ValueError(f"min_scale must be in (0, 1], got {self.min_scale!r}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience!r}")
        self._logs = deque(maxlen=self.window)

    def trend(self) -> float:
        """exp(slope · (window − 1)) of the current window: the factor by which the mismatch grew across it."""
        n = len(self._logs)
        if n < 2:
            return 1.0
        mean_x, mean_y = (n - 1) / 2, sum(self._logs) / n
        cov = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(self._logs))
        var = sum((i - mean_x) ** 2 for i in range(n))
        return math.exp(cov / var * (n - 1))

    def update(self, k3_kl: float) -> float:
        if not math.isfinite(k3_kl) or k3_kl <= 0:  # an on-policy step (k3 = 0) carries no trend information
            return self.scale
        self._logs.append(math.log(k3_kl))
        if len(self._logs) == self.window and self.trend() > self.rise:
            self.scale = max(self.min_scale, self.scale * self.factor)
            self._logs.clear()
            self._calm = 0
            return self.scale
        self._calm += 1
        if self._calm >= self.patience and self.scale < 1.0:
            self.scale = min(1.0, self.scale / self.factor)
            self._calm = 0
        return self.scale

    def state_dict(self) -> dict:
        return {"scale": self.scale, "logs": list(self._logs), "calm": self._calm}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._logs = deque(state["logs"], maxlen=self.window)
        self._calm = int(state["calm"])
