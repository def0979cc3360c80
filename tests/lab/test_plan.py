"""Mismatch sources, settings and sweep plans: names → exact engine settings, combinations, validation."""

from __future__ import annotations

import pytest

from offpolicy.lab.mismatch import (
    ENGINE_BASE,
    SOURCES,
    canonical_mismatch,
    describe_mismatch,
    mismatch_overrides,
    mismatch_settings,
)
from offpolicy.lab.plan import plan_sweep, planned_config
from offpolicy.lab.settings import SETTINGS, get_setting


@pytest.mark.parametrize("name, dtype, weight_bits, kv_bits, noise", [
    ("none", "float32", None, None, 0.0),
    ("bf16", "bfloat16", None, None, 0.0),
    ("int8", "bfloat16", 8, None, 0.0),
    ("int4", "bfloat16", 4, None, 0.0),
    ("kv8", "bfloat16", None, 8, 0.0),
    ("kv4", "bfloat16", None, 4, 0.0),
    ("int8+kv4", "bfloat16", 8, 4, 0.0),
    ("noise", "float32", None, None, 0.3),
    ("bf16+noise", "bfloat16", None, None, 0.3),
    ("w4a4", "bfloat16", None, None, 0.0),
    ("fp8+kv8", "bfloat16", None, 8, 0.0),
])
def test_each_source_is_a_complete_engine(tmp_path, name, dtype, weight_bits, kv_bits, noise):
    from offpolicy.train.config import load_config

    # a base that says something else must not leak in: every engine field is set by the source
    base = ["rollout.dtype=float16", "rollout.kv_cache=false", "rollout.weight_bits=2", "rollout.logit_noise=9"]
    r = load_config(None, [*base, *mismatch_overrides(name)]).rollout
    assert (r.dtype, r.kv_cache, r.weight_bits, r.kv_cache_bits, r.logit_noise) == (dtype, True, weight_bits,
                                                                                      kv_bits, noise)
    assert r.quant == {"w4a4": "nvfp4", "fp8+kv8": "fp8"}.get(name)  # every other source sets no format


def test_combinations():
    assert canonical_mismatch("kv4+int8") == canonical_mismatch(" int8 + kv4 ") == "int8+kv4"
    assert mismatch_settings("kv4+int8") == {**ENGINE_BASE, "rollout.dtype": "bfloat16", "rollout.weight_bits": 8,
                                             "rollout.kv_cache_bits": 4}
    assert describe_mismatch("int8+kv4") == f"{SOURCES['int8'][1]}; {SOURCES['kv4'][1]}"
    for bad, message in [("int8+int4", "'int8' sets rollout.weight_bits=8 but 'int4' sets rollout.weight_bits=4"),
                         ("none+bf16", "'none' is the control and cannot be combined"),
                         ("bf16+bf16", "names a source twice"), ("fp6", "unknown source 'fp6'"), ("", "is empty")]:
        with pytest.raises(ValueError, match=message):
            mismatch_overrides(bad)


def test_settings_are_plain_and_valid(tmp_path):
    assert set(SETTINGS) >= {"quick", "full"}
    quick = get_setting("quick")
    quick["presets"].append("x")  # a copy: the module's dict stays as it is
    assert "x" not in SETTINGS["quick"]["presets"]
    assert SETTINGS["quick"]["steps"] == 16 and SETTINGS["full"]["steps"] == 100
    for name, s in SETTINGS.items():
        assert s["seeds"] >= 3 and "none" in s["mismatches"]
        assert not any(m in SOURCES and m == "noise" for m in s["mismatches"])  # logit noise is only an extra
        plan = plan_sweep(tmp_path, name)  # every run of every setting is a valid config
        controlled = len(s.get("control_presets", s["presets"]))
        controls = 1 + len(s.get("control_mismatches", []))  # "none" and the engines that are controls
        treated = len(s["presets"]) * (len(s["mismatches"]) - controls)
        assert len(plan.runs) == (treated + controlled * controls) * s["seeds"]
        cfg = planned_config(plan.runs[0])
        task = "free_digits" if name == "real_free" else "pattern"  # real_free: the task with free digits
        model = "lab-moe" if name == "moe" else "lab"  # moe: the mixture-of-experts lab model
        assert (cfg.model.path, cfg.task.name, cfg.task.options, cfg.run.threads) == (model, task, {"length": 32}, 1)


def test_plan(tmp_path):
    plan = plan_sweep(tmp_path, "quick", presets="naive, alp", mismatches="kv4+int8", seeds=3, steps=7,
                      overrides=["optim.lr=1e-4"])
    assert plan.mismatches == ["none", "int8+kv4"]  # the control first, names canonical
    assert [r.name for r in plan.runs[:4]] == ["naive__none__s0", "naive__none__s1", "naive__none__s2",
                                               "naive__int8+kv4__s0"]
    assert plan.runs[-1].dir == "runs/alp__int8+kv4__s2"
    cfg = planned_config(plan.runs[-1])
    assert (cfg.algorithm.preset, cfg.alp.enabled, cfg.run.seed, cfg.run.steps) == ("alp", True, 2, 7)
    assert cfg.optim.lr == 1e-4 and cfg.rollout.weight_bits == 8 and cfg.rollout.kv_cache_bits == 4
    assert cfg.run.out_dir == str(tmp_path / "runs" / "alp__int8+kv4__s2")
    assert plan.overrides[-1] == "optim.lr=1e-4"
    with pytest.raises(ValueError, match=r"--mismatch names the same engine twice"):
        plan_sweep(tmp_path, "quick", mismatches="int8+kv4,kv4+int8")
    with pytest.raises(ValueError, match=r"--presets names an entry twice"):
        plan_sweep(tmp_path, "quick", presets="mis,mis")
    with pytest.raises(ValueError, match=r"--steps must be an int >= 1, got 0"):
        plan_sweep(tmp_path, "quick", steps=0)
    with pytest.raises(ValueError, match=r"override 'optim.lr' must look like key.sub=value"):
        plan_sweep(tmp_path, "quick", overrides=["optim.lr"])
    with pytest.raises(ValueError, match=r"override 'run.out_dir=x': the sweep sets run.out_dir itself \(use --out\)"):
        plan_sweep(tmp_path, "quick", overrides=["run.out_dir=x"])


def test_cli_help_lists_every_source():
    from typer.testing import CliRunner

    from offpolicy.cli import app

    text = CliRunner().invoke(app, ["lab", "--help"], env={"COLUMNS": "200"}).output
    assert all(name in text for name in SOURCES)


def test_the_quick_setting_runs_the_control_for_naive_only(tmp_path):
    plan = plan_sweep(tmp_path, "quick")
    assert sorted({(r.preset, r.mismatch) for r in plan.runs}) == [("naive", "lag8"), ("naive", "none"),
                                                                  ("tis", "lag8")]
    # presets named on the command line keep the setting's choice: TIS on the fp32 engine would repeat naive
    plan = plan_sweep(tmp_path, "quick", presets="naive,tis")
    assert ("tis", "none") not in {(r.preset, r.mismatch) for r in plan.runs}


def test_variants_run_their_preset_with_a_controller(tmp_path):
    plan = plan_sweep(tmp_path, "control", presets="trm,trm_adaptive", mismatches="lag8", seeds=3, steps=5)
    assert [r.dir for r in plan.runs[:4]] == ["runs/trm__none__s0", "runs/trm__none__s1", "runs/trm__none__s2",
                                              "runs/trm__lag8__s0"]
    adaptive = [r for r in plan.runs if r.preset == "trm_adaptive"]
    assert len(adaptive) == 6 and adaptive[0].dir == "runs/trm_adaptive__none__s0"
    cfg = planned_config(adaptive[-1])
    assert cfg.algorithm.preset == "trm" and cfg.control.trm_acceptance == 0.7 and cfg.rollout.sync_every == 8
    assert planned_config(plan.runs[0]).control.trm_acceptance is None
    with pytest.raises(ValueError, match="'trm_fancy' is not a preset; choose from .*trm_adaptive"):
        plan_sweep(tmp_path, "control", presets="trm_fancy")


def test_quant_sources_and_setting(tmp_path):
    """The activation-quantised engines as lab sources, and the ``quant`` setting's plan."""
    from offpolicy.train.config import load_config

    assert mismatch_settings("w4a16")["rollout.quant"] == "nvfp4a16"
    assert canonical_mismatch("kv4+w4a4") == "w4a4+kv4"  # weights before the KV cache, as int4+kv4
    for name in ("fp8", "fp8-dynamic", "fp8-block", "mxfp8", "w4a16", "w4a4"):
        r = load_config(None, mismatch_overrides(name)).rollout
        assert (r.dtype, r.engine, r.weight_bits) == ("bfloat16", "hf", None) and r.quant is not None
    with pytest.raises(ValueError, match="both quantise the weights"):
        load_config(None, mismatch_overrides("int4+w4a4"))  # both quantise the weights: refused by the config
    plan = plan_sweep(tmp_path, "quant")
    presets = ["naive", "tis", "icepop", "score_centering", "score_centering_tis", "dvp", "m2po"]
    assert plan.mismatches == ["none", "w4a4", "fp8"]
    assert sorted({(r.preset, r.mismatch) for r in plan.runs}) == sorted(
        [("naive", "none")] + [(p, m) for p in presets for m in ("w4a4", "fp8")])
    assert len(plan.runs) == 15 * 3 and {r.steps for r in plan.runs} == {60}
    quant = {r.mismatch: planned_config(r).rollout.quant for r in plan.runs}
    assert quant == {"none": None, "w4a4": "nvfp4", "fp8": "fp8"}


def test_presets_asked_for_keep_the_settings_control_choice(tmp_path):
    plan = plan_sweep(tmp_path, "quant", presets="naive,tis", mismatches="w4a4", seeds=1)
    assert sorted({(r.preset, r.mismatch) for r in plan.runs}) == [("naive", "none"), ("naive", "w4a4"),
                                                                  ("tis", "w4a4")]
    plan = plan_sweep(tmp_path, "quant", presets="tis", mismatches="w4a4", seeds=1)  # no control named: tis runs it
    assert sorted({(r.preset, r.mismatch) for r in plan.runs}) == [("tis", "none"), ("tis", "w4a4")]


def test_the_recent_setting_runs_the_new_methods_on_lag8_and_w4a4(tmp_path):
    plan = plan_sweep(tmp_path, "recent")
    arms = {(r.preset, r.mismatch) for r in plan.runs}
    for name in ("calibrated_is", "calibrated_clip", "delight"):
        assert {(name, "lag8"), (name, "w4a4")} <= arms and (name, "none") not in arms
    by_arm = {(r.preset, r.mismatch): planned_config(r) for r in plan.runs if r.name.endswith("__s0")}
    assert by_arm[("calibrated_is", "lag8")].algorithm.corrections == [{"name": "calibrated_is"}]
    assert by_arm[("delight", "w4a4")].algorithm.corrections == [{"name": "delight"}]
    assert by_arm[("calibrated_clip", "lag8")].algorithm.objective == "calibrated_clip"
    assert by_arm[("calibrated_clip", "lag8")].algorithm.preset == "naive"
