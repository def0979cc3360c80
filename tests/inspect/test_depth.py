"""The mismatch by depth in inspect's report (``by_position``, ``depth.png``, the HTML table, the engines' table)."""

from __future__ import annotations

import json

import pytest
import torch

from offpolicy.inspect import Measurements, TokenData, write_report
from offpolicy.inspect.depth import depth_summary
from offpolicy.inspect.depth_table import depth_table, main


def _growing(kl_kind: str | None = "exact") -> Measurements:
    # 4 sequences of 40 tokens (row 3: 20, then padding); μ drifts from π by 1e-3·t at position t, so every statistic
    # grows with depth; the per-token KL is given as 1e-6·t (as the exact one would be)
    t = torch.arange(40, dtype=torch.float32)
    trainer = torch.full((4, 40), -1.0)
    rollout = trainer - 1e-3 * t
    mask = torch.ones(4, 40, dtype=torch.bool)
    mask[3, 20:] = False
    kl = (1e-6 * t).expand(4, 40).clone() if kl_kind else None
    tokens = TokenData(completion_ids=torch.zeros(4, 40, dtype=torch.long), mask=mask, trainer_logp=trainer,
                       rollout_logp=rollout, kl=kl, kl_kind=kl_kind, prompt_ids=[[1, 2], [1, 2, 3], [1], [1, 2]])
    return Measurements(tokens=tokens, meta={"source": "test"})


def test_summary_by_hand():
    d = depth_summary(_growing())
    assert d["edges"] == [0, 8, 16, 32, 64] and d["bins"][0] == "pos00000-00007"
    assert d["tokens"] == [32, 32, 52, 24]  # bin [16, 32): 16 tokens × 3 rows + 4 of row 3 (16 … 19); [32, 64): 8 × 3
    # bin [0, 8): r = 1e-3·t, t = 0 … 7: mean |r| = 1e-3 · 3.5; Tinker's v1 = mean(μ − π) = −3.5e-3
    assert d["logp_abs_diff_mean"][0] == pytest.approx(3.5e-3, rel=1e-4)
    assert d["kl"][0] == pytest.approx(-3.5e-3, rel=1e-4)
    # bin [32, 64): t = 32 … 39, mean 35.5: |r| 35.5e-3; the per-token KL 35.5e-6 (source "exact")
    assert d["logp_abs_diff_mean"][3] == pytest.approx(35.5e-3, rel=1e-4)
    assert d["token_kl"][3] == pytest.approx(35.5e-6, rel=1e-4) and d["token_kl_source"] == "exact"
    assert d["prompt_length_mean"] == 2.0 and d["nll"] == [1.0] * 4  # −log π = 1 everywhere
    # deepest bin with ≥ 20 tokens over the first: |r| 35.5 / 3.5 = 10.14; ½r² ≈ (mean t² ratio) 1261.25/17.5 = 72.07
    assert d["deepest_over_first"]["logp_abs_diff_mean"] == pytest.approx(35.5 / 3.5, rel=1e-3)
    assert d["deepest_over_first"]["k2_kl"] == pytest.approx((sum(x * x for x in range(32, 40)) / 8)
                                                             / (sum(x * x for x in range(8)) / 8), rel=1e-3)
    assert d["deepest_over_first"]["token_kl"] == pytest.approx(10.14, rel=1e-3)
    no_logits = depth_summary(_growing(None))
    assert no_logits["token_kl"] is None and no_logits["token_kl_source"] is None
    assert no_logits["deepest_over_first"]["token_kl"] is None


def test_report_has_the_profile_the_figure_and_the_table(tmp_path):
    summary = write_report(_growing("topk"), tmp_path)
    assert summary["by_position"]["token_kl_source"] == "topk lower bound"
    assert (tmp_path / "depth.png").is_file() and summary["figures"]["depth"] == "depth.png"
    assert json.loads((tmp_path / "report.json").read_text())["by_position"]["tokens"] == [32, 32, 52, 24]
    html = (tmp_path / "report.html").read_text()
    assert "Mismatch by position in the response" in html and "32–63" in html
    # the engines' table from report.json files (what `python -m offpolicy.inspect.depth_table` prints)
    table = depth_table({"a": summary, "b": summary}).splitlines()
    assert table[0].startswith("| engine | positions | tokens | k3 KL") and len(table) == 2 + 2 * 4
    assert table[2].startswith("| a | 0–7 | 32 |")


def test_the_command_prints_one_table(tmp_path, capsys):
    write_report(_growing(), tmp_path / "one")
    assert main([str(tmp_path / "one" / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "| test (one) | 32–63 | 24 |" in out or "| one (one) | 32–63 | 24 |" in out
    (tmp_path / "old.json").write_text("{}")
    with pytest.raises(ValueError, match="no by_position"):
        main([str(tmp_path / "old.json")])
