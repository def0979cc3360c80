"""The staleness verdict on a hand-made sweep folder with known last-quarter rewards, and the stale setting's plan."""

from __future__ import annotations

import json

import pytest

from offpolicy.lab.mismatch import mismatch_overrides
from offpolicy.lab.settings import get_setting
from offpolicy.lab.staleness import (
    largest_lag_within_noise,
    markdown_table,
    plot_staleness,
    staleness_report,
    verdict_table,
)

STEPS = 8  # quarter = 2 steps: the last-quarter reward is the mean of steps 7 and 8
# last-quarter reward per seed (both last steps hold it)
LAST = {
    ("naive", "none"): [0.80, 0.85, 0.90],
    ("naive", "lag4"): [0.82, 0.86, 0.88],   # overlaps [0.80, 0.90]: within noise
    ("naive", "lag16"): [0.50, 0.55, 0.60],  # below: lower
    ("naive", "lag64"): [0.85, 0.86, 0.87],  # within noise again, but the method broke at lag16
    ("m2po", "lag4"): [0.70, 0.75, 0.79],    # max 0.79 < 0.80: lower already at lag4
    ("m2po", "lag16"): [0.80, 0.81, 0.82],
}


def _write_sweep(root):
    runs = []
    for (preset, mismatch), lasts in LAST.items():
        for seed, last in enumerate(lasts):
            d = root / "runs" / f"{preset}__{mismatch}__s{seed}"
            d.mkdir(parents=True)
            rows = []
            for t in range(1, STEPS + 1):
                reward = last if t > STEPS - 2 else 0.1 * t
                row = {"step": t, "reward/mean": reward, "rollout_correction/k3_kl": 1e-3, "loss/grad_norm": 1.0 + t,
                       "correction/masked_frac": 0.0}
                if preset == "m2po":
                    row["score_centering/drift_tv"] = 0.1
                rows.append(row)
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            if (preset, mismatch) != ("m2po", "lag16"):  # the trainer's evaluated reward: 0.01 above the engine's
                (d / "eval.json").write_text(json.dumps({"step": STEPS, "reward": last + 0.01, "samples": 64}))
            runs.append({"preset": preset, "mismatch": mismatch, "seed": seed, "dir": f"runs/{d.name}", "steps": STEPS})
    summary = {"runs": runs, "plan": {"seeds": [0, 1, 2], "steps": STEPS, "runs": runs}}
    (root / "summary.json").write_text(json.dumps(summary))


def test_report_on_a_known_sweep(tmp_path):
    _write_sweep(tmp_path)
    report = staleness_report(tmp_path)
    t = report["table"]
    assert t["naive|lag4"]["vs_control"]["verdict"] == "within noise"
    assert t["naive|lag16"]["vs_control"]["verdict"] == "lower"
    assert t["naive|lag16"]["vs_control"]["diff"] == pytest.approx(0.55 - 0.85)
    assert t["m2po|lag4"]["vs_control"]["verdict"] == "lower"
    # naive stays within noise up to lag4 and breaks at lag16 (lag64 is not counted: it broke before)
    assert report["largest_within_noise"] == {"naive": "lag4", "m2po": None}
    numbers = t["naive|lag16"]["numbers"]
    assert numbers["reward_last"] == {"median": 0.55, "min": 0.5, "max": 0.6, "n": 3}
    assert numbers["grad_norm_max"]["median"] == 9.0 and numbers["drift_tv"]["n"] == 0
    assert t["m2po|lag4"]["numbers"]["drift_tv"]["median"] == pytest.approx(0.1)
    md = markdown_table(report)
    # first quarter: steps 1–2 at 0.1, 0.2 → 0.15
    assert "| naive | 16 | 3 | 0.560 [0.510–0.610] | 0.150 [0.150–0.150] | 0.550 [0.500–0.600] |" in md
    assert "-0.300 lower | -0.300 lower" in md and "(control)" in md
    assert t["naive|lag4"]["eval_vs_control"]["verdict"] == "within noise"
    assert t["m2po|lag16"]["eval_vs_control"]["verdict"] == "too few seeds"  # no eval.json there
    assert report["largest_within_noise_eval"] == {"naive": "lag4", "m2po": None}
    assert report["largest_not_below"] == {"naive": "lag4", "m2po": None}
    assert "| naive | lag4 | lag4 | lag4 | lag4 |" in verdict_table(report)
    png = plot_staleness(report, tmp_path / "staleness.png")
    assert png.stat().st_size > 10_000
    only = plot_staleness(report, tmp_path / "naive_only.png", presets=["naive"])  # one line fewer: another picture
    assert only.stat().st_size > 10_000 and only.read_bytes() != png.read_bytes()


def test_the_command_draws_a_figure_per_group_of_presets_it_finds(tmp_path, capsys):
    # naive and m2po are both main presets: one figure; a sweep with a gate adds the gates' figure
    from offpolicy.lab.staleness import main

    _write_sweep(tmp_path / "sweep")
    main([str(tmp_path / "sweep"), str(tmp_path / "out")])
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == ["staleness.png"]
    summary = json.loads((tmp_path / "sweep" / "summary.json").read_text())
    for run in summary["runs"]:
        if run["preset"] == "m2po":
            new = run["dir"].replace("m2po", "kl_gate")
            (tmp_path / "sweep" / run["dir"]).rename(tmp_path / "sweep" / new)
            run["preset"], run["dir"] = "kl_gate", new
    (tmp_path / "sweep" / "summary.json").write_text(json.dumps(summary))
    main([str(tmp_path / "sweep"), str(tmp_path / "out2")])
    assert sorted(p.name for p in (tmp_path / "out2").glob("*.png")) == ["staleness.png", "staleness_gates.png"]
    assert "| kl_gate | 4 | 3 |" in (tmp_path / "out2" / "staleness_table.md").read_text()


def test_largest_lag_skips_missing_lags():
    assert largest_lag_within_noise({"lag64": {"within_noise": True}, "lag4": {"within_noise": True}}) == "lag64"
    assert largest_lag_within_noise({"lag1": {"within_noise": False}}) is None
    # separated above the control: not within noise, but not a break either
    above = {"lag1": {"within_noise": True}, "lag4": {"within_noise": False, "verdict": "higher"},
             "lag16": {"within_noise": False, "verdict": "lower"}}
    assert largest_lag_within_noise(above) == "lag1"
    assert largest_lag_within_noise(above, or_higher=True) == "lag4"


def test_stale_setting_and_lag_sources():
    s = get_setting("stale")
    assert s["presets"] == ["naive", "tis", "m2po", "m2po_tau0p2", "m2po_areal", "ipo", "score_centering",
                            "score_centering_reinforce", "mis", "icepop", "kl_gate", "kl_gate_seq"]
    assert s["mismatches"] == ["none", "lag1", "lag4", "lag8", "lag16", "lag64"] and s["seeds"] >= 3
    assert "rollout.sync_every=2" in mismatch_overrides("lag1")
    assert "rollout.sync_every=64" in mismatch_overrides("lag64")
    with pytest.raises(ValueError, match="lag1"):
        mismatch_overrides("lag1+lag16")  # two lags set the same field


def test_evaluate_run_scores_the_trainer_weights_on_fixed_prompts(tmp_path, tiny_run):
    from offpolicy.lab.staleness import evaluate_run
    from offpolicy.train.config import load_config
    from offpolicy.train.loop import train

    cfg = load_config(None, [*tiny_run, "task.name=pattern", f"run.out_dir={tmp_path}", "run.steps=1",
                             "run.progress=false",
                             "run.tensorboard=false", "rollout.sync_every=4"])
    train(cfg)
    first = evaluate_run(tmp_path, prompts=2)
    assert first["step"] == 1.0 and first["samples"] == 2 * cfg.algorithm.group_size and 0.0 <= first["reward"] <= 1.0
    assert json.loads((tmp_path / "eval.json").read_text()) == first
    assert evaluate_run(tmp_path, prompts=2) == first  # the same prompts and sampling seed every time
    with pytest.raises(ValueError, match="no checkpoint"):
        evaluate_run(tmp_path / "nothing")


def test_stale_variants_build_the_method_they_name():
    from offpolicy.lab.settings import resolve_preset
    from offpolicy.train.config import load_config
    from offpolicy.train.presets import PRESETS, build_chain

    def params(name):
        preset, extra = resolve_preset(name)
        cfg = load_config(None, [f"algorithm.preset={preset}", *extra])
        return cfg, build_chain(PRESETS[preset], cfg.algorithm)

    cfg, corr = params("m2po_tau0p2")
    assert corr.config["threshold"] == 0.2 and corr.config["quadrants"] is True
    cfg, corr = params("m2po_areal")
    assert corr.config == {"threshold": 0.04, "quadrants": False, "source": "mismatch"}
    cfg, _ = params("score_centering_reinforce")
    assert cfg.algorithm.objective == "reinforce" and cfg.algorithm.preset == "score_centering"
    cfg, corr = params("kl_gate")
    assert repr(corr) == ("gated_is(level='token', mode='mask', gating='binary_kl', lower=None, upper=0.005, "
                          "source='mismatch')") and cfg.algorithm.preset == "naive"
    _, corr = params("kl_gate_seq")
    assert corr.config["level"] == "geometric" and corr.config["upper"] == 0.005
