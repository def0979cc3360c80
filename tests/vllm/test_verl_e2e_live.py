"""verl end to end on a CPU: ``python -m verl.trainer.main_ppo`` (verl 0.9.1's own trainer loop, Ray local, the FSDP2
actor, vLLM's CPU build as verl's rollout) trains the embedded tiny model with the plug-in — weights pushed into vLLM
after every step, a recipe file's DVP + TIS, calibrated clipping as verl's policy loss, the sync check after every
sync — through examples/verl_end_to_end.py, and the ALP + score centering recipe file. Then one run with the actor
sharded over two FSDP ranks (gloo), DVP, calibrated IS and the delight gate: verl's hybrid engine runs two vLLM
replicas (TP = 1), each fed by its own rank's push and sampling inside DVP's safe set, and the check scores both; its
first syncs pass and its push from step 3 does nothing, which must fail the run naming that sync (one run, not one
per feature, and 3 steps, not 6: each run's time is start-up, and two vLLM servers and two trainer processes start
on the same 2 cores).

The runs are slow (minutes on 2 cores each): marked ``slow``. Skipped without verl, ``transfer_queue`` or vLLM (this
folder's conftest skips without vLLM).
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install 'offpolicy[verl-ci]')")
pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs transfer_queue (pip install transferqueue)")
pytest.importorskip("ray", reason="verl's trainer needs Ray")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "verl_end_to_end.py"
STEPS = 6
RANKS_STEPS = 3  # two ranks: two trainer processes and two vLLM servers on the shared cores


def _example():
    spec = importlib.util.spec_from_file_location("verl_end_to_end_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _example()


def _flat(text: str) -> str:
    """The log without Ray's line prefixes and white space: verl pretty-prints its config to a width, wrapping a key
    and its value onto two lines behind Ray's prefix as the run's temporary paths happen to fall."""
    return re.sub(r"\s+", "", re.sub(r"\x1b\[\d+m\([^)]*\)\x1b\[0m", "", text))


RECIPE = Path(__file__).resolve().parents[1] / "data" / "recipes" / "dvp_tis.yaml"


@pytest.mark.slow
def test_main_ppo_trains_with_every_sync_checked(example, tmp_path):
    """At verl's own precision defaults (FSDP's bf16 mixed precision for the actor, a bf16 vLLM engine) — what a
    verl user runs; the run below keeps both sides fp32. The plug-in's settings are the recipe file the reference
    trainer and TRL's train() run (tests/train/test_config_recipe.py, tests/integrations/test_trl_recipe.py), handed
    over unchanged: DVP (ρ 1e-3, through the plug-in's agent loop) + token TIS + the sync check (warn). verl's
    policy loss is the plug-in's calibrated clipping (arXiv 2609.22870) by name, ``offpolicy_calibrated_clip``: its
    ratio is against μ (max 1.001–1.067 measured: at bf16 μ ≠ π_old), and its metric reaches verl's step log. The
    tiny model's bf16 mismatch stays inside the clip floor, so the range widened at no step of the measured runs: the
    widening itself is tested by hand-computed numbers (tests/objectives/test_calibrated_clip.py,
    tests/integrations/test_verl_recent_methods.py)."""
    result = example.run(STEPS, log=tmp_path / "main_ppo.log", precision="bf16", recipe=RECIPE,
                         loss_mode="offpolicy_calibrated_clip")
    assert result["rc"] == 0, result["tail"]
    assert result["steps"] == STEPS, result["tail"]
    # the initial sync (calibration) and one per step, every one passed and logged under verl's step metrics
    assert result["checks"] == STEPS + 1 and result["passed"] == STEPS + 1, result["tail"]
    assert result["sync_ok"] == [1.0] * STEPS
    assert math.isfinite(result["reward_first"]) and math.isfinite(result["reward_last"])
    text = Path(result["log"]).read_text(errors="replace")
    assert "rollout_corr/" in text  # TIS ran in the driver after verl's advantages
    flat = _flat(text)
    assert "'dtype':'bfloat16'" in flat  # verl's config dump: the rollout and the actor's mixed precision in bf16
    assert f"'OFFPOLICY_VERL':'{{recipe:{RECIPE}}}'" in flat and "'default_agent_loop':'offpolicy_agent'" in flat
    assert "'loss_mode':'offpolicy_calibrated_clip'" in flat
    for step in result["metrics"]:  # the names the trainer and TRL log for the same file, under verl's prefix
        assert {"rollout_corr/tis/weight_mean", "rollout_corr/tis/kept_frac"} <= set(step), sorted(step)
        # DVP's keep mask from π_old's safe set ahead of TIS, as the reference trainer chains it: vLLM sampled
        # inside its own min-p set, which a bf16 actor's set need not hold
        assert 0.0 <= step["rollout_corr/dvp_keep/masked_frac"] <= 1.0, sorted(step)
        assert 0.0 < step["rollout_corr/dvp/mass_min"] <= step["rollout_corr/dvp/mass_mean"] <= 1.0 + 1e-6, step
        widened = [v for k, v in step.items() if k.endswith("loss/calibrated_widened_low")]
        assert len(widened) == 1 and 0.0 <= widened[0] <= 1.0, sorted(step)
        # one minibatch, one epoch: π_θ = π_old in the update (verl's ppo_kl 0), so a loss ratio other than 1 is
        # π_θ/μ — the calibrated clip got the engine's μ (without it, it is PPO on π_θ/π_old = 1)
        assert step["actor/ppo_kl"] == 0.0 and max(step["actor/loss/ratio_max"] - 1.0,
                                                    1.0 - step["actor/loss/ratio_min"]) > 1e-4, step
    # μ from a bf16 engine against a bf16 forward of fp32 weights: a real mismatch, not round-off
    assert result["rollout_corr"]["rollout_corr/logp_abs_diff_max"] > 1e-4, result["rollout_corr"]


ALP_RECIPE = RECIPE.parent / "alp_score_centering.yaml"
ALP_STEPS = 3


@pytest.mark.slow
def test_main_ppo_runs_the_alp_score_centering_recipe_file_unchanged(example, tmp_path):
    """The second recipe file the reference trainer and TRL's train() run (tests/train/test_config_recipe.py,
    tests/vllm/test_trl_live.py), at verl's precision defaults: ALP on the actor's update forward, and score centering
    on the engine's top-20, which the plug-in's agent loop records from vLLM (the engine raises at the first update
    when a batch lacks it, so a finished run had it at every step). σ and the centring's drift and head mass reach
    verl's step metrics under the names the other hosts log, behind verl's ``actor/`` prefix."""
    result = example.run(ALP_STEPS, log=tmp_path / "alp_centering.log", precision="bf16", recipe=ALP_RECIPE)
    assert result["rc"] == 0, result["tail"]
    assert result["steps"] == ALP_STEPS, result["tail"]
    assert result["checks"] == ALP_STEPS + 1 and result["passed"] == ALP_STEPS + 1, result["tail"]
    text = Path(result["log"]).read_text(errors="replace")
    flat = _flat(text)
    assert f"'OFFPOLICY_VERL':'{{recipe:{ALP_RECIPE}}}'" in flat and "'default_agent_loop':'offpolicy_agent'" in flat
    for step in result["metrics"]:
        assert 0.025 < step["actor/alp/sigma_mean"] < 0.035, step  # init_std 3e-2, three small steps
        assert step["actor/alp/sigma_min"] <= step["actor/alp/sigma_mean"] <= step["actor/alp/sigma_max"], step
        assert {k for k in step if k.startswith("actor/alp/sigma/")}, sorted(step)  # one σ per perturbed layer
        # score centering's drift and head mass, the names the trainer and TRL log. The top-20 holds most of q; the
        # bound on the drift was set after a run (0.04–0.26 over three steps of about nine response tokens each, bf16
        # engine against ALP's noisy bf16 forward) to catch a top-K laid one position off, whose q and π are
        # different positions' peaked distributions (a total variation near 1), not to pin the mismatch
        assert 0.0 <= step["actor/score_centering/drift_tv"] < 0.5, step
        assert 0.5 < step["actor/score_centering/head_mass_q"] <= 1.0 + 1e-6, step


def test_precision_is_fp32_on_both_sides_or_verls_defaults(example, tmp_path):
    def config(precision):
        out = example.overrides(tmp_path, tmp_path, tmp_path, 3, 2, 2, {}, tmp_path, precision=precision)
        return dict(item.split("=", 1) for item in out)

    fp32, bf16 = config("fp32"), config("bf16")
    assert fp32["actor_rollout_ref.rollout.dtype"] == "float32"
    assert fp32["+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"] == "fp32"
    assert bf16["actor_rollout_ref.rollout.dtype"] == "bfloat16"
    assert bf16["actor_rollout_ref.actor.fsdp_config.dtype"] == "bfloat16"
    assert not any("mixed_precision" in key for key in bf16)
    with pytest.raises(ValueError, match="precision must be one of"):
        config("fp8")


def test_the_correction_is_an_argument_tis_unless_told(example, tmp_path):
    def settings(**kw):
        out = example.overrides(tmp_path, tmp_path, tmp_path, 3, 2, 2, {}, tmp_path, **kw)
        return next(v for k, v in (item.split("=", 1) for item in out) if k.endswith("env_vars.OFFPOLICY_VERL"))

    assert settings() == "'{correction: {name: tis, upper: 2.0}, sync_check: error}'"
    assert settings(correction="calibrated_is", dvp=0.05) == ("'{correction: calibrated_is, sync_check: error, "
                                                              "sampling: {min_p: 0.05}}'")
    from offpolicy.integrations.verl.settings import settings_from_text
    from offpolicy.registry import build_correction

    parsed = settings_from_text(settings(correction="calibrated_is").strip("'"))  # as the plug-in reads the variable
    assert repr(build_correction(parsed.correction)).startswith("calibrated_is(")


def test_the_embedded_models_resolve_by_name_with_their_tasks(example, tmp_path):
    """``--model lab-moe`` (and ``lab``) where ``tiny`` is: the model's files with a chat template, the pattern task's
    rows, and verl's reward function grading them with the task's own reward. (Resolution only: a verl run on
    lab-moe is not part of these tests.)"""
    import json

    import pandas as pd

    copy = example.model_copy(tmp_path, "lab-moe")
    assert json.loads((copy / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert json.loads((copy / "tokenizer_config.json").read_text())["chat_template"] == example.CHAT_TEMPLATE
    out = example.overrides(copy, tmp_path, tmp_path, 3, 2, 2, {}, tmp_path)
    assert f"actor_rollout_ref.model.path={copy}" in out
    train, _ = example.write_data(tmp_path, 3, 2, "lab-moe")
    rows = pd.read_parquet(train)
    assert len(rows) == 6 and set(rows["data_source"]) == {"offpolicy/pattern"}
    row = rows.iloc[0]
    info = dict(row["extra_info"])
    assert info["model"] == "lab-moe" and row["prompt"][0]["content"] == info["pattern"] + ">"
    truth = row["reward_model"]["ground_truth"]
    assert example.compute_score(row["data_source"], truth, truth, info) == 1.0  # the exact repetition
    assert example.compute_score(row["data_source"], "x" * len(truth), truth, info) == 0.0
    # the tiny model's arithmetic rows keep verl's closeness reward and carry no task name
    tiny, _ = example.write_data(tmp_path, 1, 2)
    first = pd.read_parquet(tiny).iloc[0]
    assert first["data_source"] == example.DATA_SOURCE and "model" not in dict(first["extra_info"])
    answer = int(first["reward_model"]["ground_truth"])
    assert example.compute_score(example.DATA_SOURCE, str(answer + 1), str(answer)) == 0.5
    with pytest.raises(ValueError, match="unknown embedded model 'lab-mo'"):
        example.model_copy(tmp_path, "lab-mo")


def test_ranks_set_verls_world_size_and_split_the_batch(example, tmp_path):
    """``ranks`` is verl's ``trainer.n_gpus_per_node`` (and Ray's logical GPUs); each rank's micro-batch is its share
    of the step's prompts × samples rows; a rank count that does not divide them is refused."""
    def config(ranks):
        out = example.overrides(tmp_path, tmp_path, tmp_path, 3, 2, 2, {}, tmp_path, ranks=ranks)
        return dict(item.split("=", 1) for item in out)

    one, two = config(1), config(2)
    assert (one["trainer.n_gpus_per_node"], two["trainer.n_gpus_per_node"]) == ("1", "2")
    assert two["+ray_kwargs.ray_init.num_gpus"] == "2"
    assert one["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == "4"  # 2 prompts x 2 samples on one rank
    assert two["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == "2"
    assert two["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"] == "2"
    assert two["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "1"
    with pytest.raises(ValueError, match="ranks must be >= 1 and divide prompts × samples = 4, got 3"):
        config(3)


@pytest.mark.slow
def test_two_fsdp_ranks_under_dvp_check_every_sync_on_both_replicas_and_catch_a_push_that_does_nothing(
        example, tmp_path):
    """One two-rank run in fp32 (CI's time: two trainer processes and two vLLM servers start once), with DVP and
    calibrated IS then the delight gate: the initial sync and the syncs after steps 1 and 2 pass on both replicas, the
    push from step 3 does nothing and the run stops there, naming that sync and the replica.

    DVP (min-p 0.05): vLLM samples inside the safe set through the plug-in's agent loop on each replica, the actor
    scores over its own, and the engine's μ equals the actor's π_old to round-off — a recipe applied on one side only
    would part them by the safe set's missing mass. The correction is calibrated IS (arXiv 2609.32444) then the delight
    gate (arXiv 2603.20521), by name: with μ = π_old to round-off calibrated IS's cap is barely above 1 and caps
    nothing; delight's weights are σ(A · surprisal), never all 1 (0.49–0.52 on average, measured)."""
    result = example.run(RANKS_STEPS, ranks=2, break_sync_at=RANKS_STEPS, log=tmp_path / "main_ppo_2ranks.log",
                         dvp=0.05, correction="[calibrated_is, delight]")
    assert result["rc"] != 0, result["tail"]
    text = Path(result["log"]).read_text(errors="replace")
    flat = _flat(text)
    # verl's dispatch put the probe's actor forward on both FSDP ranks; each rank's vLLM server was scored
    assert "sync check: 2 rollout replica(s), actor data-parallel size 2" in text
    assert result["steps"] == RANKS_STEPS - 1, result["tail"]  # steps 1 and 2 logged their metrics
    assert result["checks"] == RANKS_STEPS and result["passed"] == RANKS_STEPS, result["tail"]
    assert result["sync_ok"] == [1.0] * (RANKS_STEPS - 1) and result["replicas"] == 2
    assert "'default_agent_loop':'offpolicy_agent'" in flat and "min_p: 0.05" in text
    assert "'OFFPOLICY_VERL':'{correction:[calibrated_is,delight]," in flat
    corr = result["rollout_corr"]
    assert corr["rollout_corr/logp_abs_diff_max"] < 1e-4, corr  # the probe calibrated under DVP
    assert corr["rollout_corr/calibrated_is/capped_frac"] == 0.0, corr
    assert 0.0 <= corr["rollout_corr/delight/suppressed_frac"] <= 1.0, corr
    assert abs(corr["rollout_corr/rollout_is_mean"] - 1.0) > 1e-3, corr
    assert "SyncCheckError" in text, result["tail"]
    assert f"verl step {RANKS_STEPS}: weight sync into the rollout engine (replica 0 of 2): " in text
