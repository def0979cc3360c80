"""The trainer with the divergence gate named in its config, logging the mismatch per position bin and the
diagnostics under Tinker's names."""

from __future__ import annotations

import math

from offpolicy.position import position_bin_edges
from offpolicy.train.config import load_config
from offpolicy.train.logging import read_metrics
from offpolicy.train.loop import train


def test_gated_is_by_name_with_the_position_profile_under_tinkers_names(tmp_path, fresh, make_overrides, varying_task):
    model, tok = fresh
    gate = "algorithm.corrections=[{name: gated_is, level: geometric, gating: binary_kl, upper: 0.005}]"
    cfg = load_config(None, make_overrides(tmp_path, "naive", steps=2, run__metric_naming="tinker",
                                           rollout__sampling__max_new_tokens=12) + [gate, "rollout.dtype=bfloat16"])
    res = train(cfg, model=model, tokenizer=tok, task=varying_task())
    assert res.steps_done == 2
    rows = read_metrics(tmp_path / "metrics.jsonl")
    for row in rows:
        assert 0.0 <= row["gated_is/masked_frac"] <= 1.0 and "gated_is/stat_mean" in row
        assert "optim/kl_sample_train_v1" in row and row["optim/kl_sample_train_v2"] >= 0
        # the response is at most 12 tokens: bins [0, 8) and [8, 16)
        width = len(position_bin_edges(12)) - 1
        keys = sorted(k for k in row if k.startswith("mismatch/by_position/tokens/"))
        assert keys == ["mismatch/by_position/tokens/pos00000-00007", "mismatch/by_position/tokens/pos00008-00015"]
        assert width == 2
        # the bins partition the step's tokens, and their token-weighted k2 is the step's (Tinker's v2)
        n = [row[k] for k in keys]
        k2 = [row[k.replace("/tokens/", "/k2_kl/")] for k in keys]
        total = sum(n)
        assert total > 0 and math.isclose(sum(a * b for a, b in zip(n, k2)) / total, row["optim/kl_sample_train_v2"],
                                          rel_tol=1e-4, abs_tol=1e-12)
