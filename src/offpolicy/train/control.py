"""The trainer's closed loop: the ``control`` config section's controllers, acting on a run between steps.

After each step, :meth:`Control.update` feeds the step's mismatch to the controllers of
:mod:`offpolicy.train.controllers` and applies what they return to the next step: TRM's thresholds and the IS band
through :meth:`~offpolicy.train.steps.TrainState.set_corrections` (the chain rebuilt from its specs with new
parameters), the learning rate through :meth:`~offpolicy.train.steps.TrainState.set_lr`. What each step used is
logged with it (``control/trm_max_kl``, ``control/trm_avg_kl``, ``control/is_lower``, ``control/is_upper``,
``control/lr``: ``optim.lr`` times the guard's factor; under an ``optim.schedule`` the loop multiplies the
schedule's rate by that factor instead, and ``optim/lr`` is the rate a step used); the controllers' state is saved in
checkpoints, so a resumed run continues the same trajectory.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import Tensor

from offpolicy.train.controllers import AcceptanceController, LRGuard, RatioBandController

BAND_CORRECTIONS = ("tis", "mis", "icepop")  # token-level IS corrections whose band the controller may widen


def _default(name: str, parameter: str) -> Any:
    """A registered correction's default value of ``parameter`` (None when it has none)."""
    from offpolicy.registry import CORRECTIONS

    p = inspect.signature(CORRECTIONS[name]).parameters.get(parameter)
    return None if p is None or p.default is inspect.Parameter.empty else p.default


def _row_statistics(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sequence max and mean of ``values`` ``[B, T]`` over valid tokens (NaN for a sequence without any)."""
    m = mask.bool()
    n = m.sum(-1)
    v = values.detach().double()
    row_max = torch.where(m, v, torch.full_like(v, -math.inf)).amax(-1)
    row_mean = torch.where(m, v, torch.zeros_like(v)).sum(-1) / n.clamp(min=1)
    empty = n == 0
    return row_max.masked_fill(empty, math.nan), row_mean.masked_fill(empty, math.nan)


class Control:
    """The controllers ``cfg.control`` asks for; :meth:`build` returns None when none is on."""

    def __init__(self, cfg: Any, state: Any) -> None:
        c = cfg.control
        self.base_lr = float(cfg.optim.lr)
        self.trm: dict[str, AcceptanceController] = {}
        self.band: RatioBandController | None = None
        self.lr_guard: LRGuard | None = None
        specs = state.correction_specs
        if c.trm_acceptance is not None:
            i = self._index(specs, ("trm",), "control.trm_acceptance")
            for key in ("max_kl", "avg_kl"):
                floor = specs[i].get(key, _default("trm", key))
                if floor is not None:
                    self.trm[key] = AcceptanceController(floor=float(floor), target=c.trm_acceptance, window=c.window)
        if c.is_max_masked is not None:
            i = self._index(specs, BAND_CORRECTIONS, "control.is_max_masked")
            spec = specs[i]
            level = spec.get("level", _default(spec["name"], "level") or "token")
            if level != "token":
                raise ValueError(f"control.is_max_masked widens a token-level band; the chain's {spec['name']!r} is "
                                 f"at level {level!r}")
            upper = spec.get("upper", _default(spec["name"], "upper"))
            lower = spec.get("lower", _default(spec["name"], "lower"))
            self.band = RatioBandController(lower=None if not lower else float(lower), upper=float(upper),
                                            max_masked=c.is_max_masked, window=c.window)
        if c.lr_guard:
            self.lr_guard = LRGuard(window=c.lr_guard_window, rise=c.lr_guard_rise, factor=c.lr_guard_factor,
                                    min_scale=c.lr_guard_min_scale, patience=c.lr_guard_patience)

    @classmethod
    def build(cls, cfg: Any, state: Any) -> Control | None:
        c = cfg.control
        if c.trm_acceptance is None and c.is_max_masked is None and not c.lr_guard:
            return None
        return cls(cfg, state)

    @staticmethod
    def _index(specs: list[dict[str, Any]], names: tuple[str, ...], key: str) -> int:
        for i, spec in enumerate(specs):
            if spec["name"] in names:
                return i
        raise ValueError(f"{key} needs a {' / '.join(names)} correction in the chain; it has "
                         f"{[s['name'] for s in specs] or 'none'}")

    @property
    def lr_scale(self) -> float:
        """The LR guard's factor on the configured rate (1 without a guard)."""
        return self.lr_guard.scale if self.lr_guard is not None else 1.0

    # -- what a step used ----------------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, controller in self.trm.items():
            out[f"control/trm_{key}"] = controller.threshold
        if self.band is not None:
            lower, upper = self.band.band
            out["control/is_upper"] = upper
            if lower is not None:
                out["control/is_lower"] = lower
        if self.lr_guard is not None:
            out["control/lr"] = self.base_lr * self.lr_guard.scale
        return out

    # -- the loop ------------------------------------------------------------------------------------------------

    def update(self, state: Any, scored: Any) -> None:
        """Feed this step's mismatch (π_old vs μ, and TRM's token divergence) to the controllers and apply their
        values to the next step."""
        mask = scored.mask
        log_ratio = (scored.old_logp - scored.rollout_logp).detach()  # log π_old − log μ
        valid = mask.bool() & torch.isfinite(log_ratio)
        if self.trm:
            divergence = scored.token_divergence
            if divergence is None:  # TRM's fallback without logits: k2 for the max test, k3 for the average test
                r = torch.where(valid, log_ratio, torch.zeros_like(log_ratio))
                max_stat, avg_stat = _row_statistics(0.5 * r**2, valid)[0], _row_statistics(r.exp() - 1 - r, valid)[1]
            else:
                max_stat, avg_stat = _row_statistics(divergence, mask)
            stats = {"max_kl": max_stat, "avg_kl": avg_stat}
            for key, controller in self.trm.items():
                controller.update(stats[key])
        if self.band is not None:
            self.band.update(log_ratio, valid)
        if self.trm or self.band is not None:
            state.set_corrections(self._specs(state.correction_specs))
        if self.lr_guard is not None:
            r = log_ratio[valid].double()
            k3 = float((r.exp() - 1 - r).mean()) if r.numel() else math.nan
            state.set_lr(self.base_lr * self.lr_guard.update(k3))

    def _specs(self, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``specs`` with the controllers' current thresholds written into their corrections."""
        out = [dict(s) for s in specs]
        if self.trm:
            spec = out[self._index(out, ("trm",), "control.trm_acceptance")]
            for key, controller in self.trm.items():
                spec[key] = controller.threshold
        if self.band is not None:
            spec = out[self._index(out, BAND_CORRECTIONS, "control.is_max_masked")]
            lower, upper = self.band.band
            spec["upper"] = upper
            if lower is not None:
                spec["lower"] = lower
        return out

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "trm": {key: c.state_dict() for key, c in self.trm.items()},
            "band": self.band.state_dict() if self.band is not None else None,
            "lr_guard": self.lr_guard.state_dict() if self.lr_guard is not None else None,
        }

    def load_state_dict(self, saved: dict[str, Any] | None, state: Any) -> None:
        """Restore the controllers and re-apply their values to ``state`` (a checkpoint of a run without control, or
        of other controllers, is refused)."""
        if saved is None or set(saved.get("trm", {})) != set(self.trm) or \
                (saved.get("band") is None) != (self.band is None) or \
                (saved.get("lr_guard") is None) != (self.lr_guard is None):
            raise ValueError("--resume: the checkpoint was written with other control settings; resume with the same "
                             "control.* values")
        for key, c in self.trm.items():
            c.load_state_dict(saved["trm"][key])
        if self.band is not None:
            self.band.load_state_dict(saved["band"])
        if self.trm or self.band is not None:
            state.set_corrections(self._specs(state.correction_specs))
        if self.lr_guard is not None:
            self.lr_guard.load_state_dict(saved["lr_guard"])
            state.set_lr(self.base_lr * self.lr_guard.scale)
