"""The corrections and objective published since September train by name in the reference trainer: calibrated IS
(arXiv 2609.32444) and the delight gate (arXiv 2603.20521) in ``algorithm.corrections``, calibrated clipping
(arXiv 2609.22870) as ``algorithm.objective``, each two steps on a bf16 engine that lags a step, with its metrics."""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.train.config import load_config
from offpolicy.train.loop import train

BY_NAME = {
    "calibrated_is": ("algorithm.corrections=[{name: calibrated_is}]", "calibrated_is/capped_frac"),
    "delight": ("algorithm.corrections=[{name: delight, temperature: 0.5}]", "delight/suppressed_frac"),
    "calibrated_clip": ("algorithm.objective=calibrated_clip", "loss/calibrated_widened_low"),
}


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_two_steps_by_name_on_a_lagging_bf16_engine(name, tmp_path, fresh, make_overrides, varying_task):
    model, tok = fresh
    before = [p.detach().clone() for p in model.parameters()]
    setting, metric = BY_NAME[name]
    cfg = load_config(None, make_overrides(tmp_path, "naive", steps=2, rollout__sync_every=2,
                                           rollout__dtype="bfloat16") + [setting])
    res = train(cfg, model=model, tokenizer=tok, task=varying_task())
    assert res.steps_done == 2
    for row in res.history:
        assert math.isfinite(row["loss/loss"]) and 0.0 <= row[metric] <= 1.0, row
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    if name == "delight":  # a gate in (0, 1): the mean weight is below 1 and above 0
        assert all(0.0 < r["delight/weight_mean"] < 1.0 for r in res.history)
    if name == "calibrated_is":  # the bf16 engine's ratio is not 1 everywhere, and the cap stays in (1, 2]
        assert all(1.0 < r["calibrated_is/cap_mean"] <= 2.0 for r in res.history)
