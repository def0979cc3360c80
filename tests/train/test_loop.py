"""The training loop: every preset runs, resume reproduces an uninterrupted run exactly, errors name the sample."""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch

from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.tasks import RewardError
from offpolicy.train.config import load_config
from offpolicy.train.logging import read_metrics
from offpolicy.train.loop import train
from offpolicy.train.scoring import exact_token_kl

PRESETS_TO_RUN = ["naive", "tis", "mis", "geo_mask", "icepop", "opsm", "trm", "dvp", "dvp_mis", "alp"]


@pytest.mark.parametrize("preset", PRESETS_TO_RUN)
def test_two_steps_every_preset(preset, tmp_path, fresh, make_overrides, varying_task):
    model, tok = fresh
    before = [p.detach().clone() for p in model.parameters()]
    cfg = load_config(None, make_overrides(tmp_path, preset))
    res = train(cfg, model=model, tokenizer=tok, task=varying_task())
    assert res.steps_done == 2 and not res.interrupted and len(res.history) == 2
    for h in res.history:
        assert math.isfinite(h["loss/loss"]) and math.isfinite(h["rollout_correction/kl"])
        assert math.isfinite(h["reward/mean"]) and h["reward/std"] > 0  # the task gives a learning signal
    # the weights moved (a gradient step happened with non-zero advantages)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    # JSONL has one line per step with the diagnostics, and the checkpoint exists
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for name in ("rollout_correction/kl", "rollout_correction/log_ppl_diff", "correction/masked_frac", "loss/clipfrac_high"):
        assert name in rows[0]
    assert res.checkpoint is not None and res.checkpoint.is_file()
    if preset == "alp":
        assert "alp/sigma_mean" in rows[0] and res.alp is not None
        assert not torch.allclose(res.alp.sigma, torch.full_like(res.alp.sigma, 0.01))  # σ was trained
    if preset.startswith("dvp"):
        assert 0.9 < rows[0]["dvp/mass_mean"] <= 1.0 and "dvp_keep/masked_frac" in rows[0]
    if preset == "trm":
        assert rows[0]["trm/divergence_exact"] == 1.0 and rows[0]["mismatch/token_kl_exact_mean"] >= 0


def test_an_overwriting_run_into_an_existing_out_dir_starts_a_new_log(tmp_path, fresh, make_overrides, varying_task):
    # with --overwrite, a second run in the same folder replaces metrics.jsonl (appending would give 4 rows, and the
    # demo's summary would read the first run's first row and the second run's last)
    from offpolicy.train.run_folder import RunReplacedWarning

    model, tok = fresh
    train(load_config(None, make_overrides(tmp_path, "naive", steps=2)), model=model, tokenizer=tok, task=varying_task())
    with pytest.warns(RunReplacedWarning):  # the second run replaces the first (see the test below)
        train(load_config(None, make_overrides(tmp_path, "naive", steps=2)), model=model, tokenizer=tok,
              task=varying_task(), overwrite=True)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_mismatch_is_visible_bf16_vs_fp32(tmp_path, fresh, make_overrides, varying_task):
    # The bf16 KV-cache engine and the fp32 trainer disagree: k3 KL > 0 and log-probs differ.
    model, tok = fresh
    cfg = load_config(None, make_overrides(tmp_path, "naive", steps=1))
    res = train(cfg, model=model, tokenizer=tok, task=varying_task())
    assert res.history[0]["rollout_correction/k3_kl"] > 0
    # with an fp32 engine and no KV cache the rollout log-probs match the trainer's almost exactly
    cfg32 = load_config(None, make_overrides(tmp_path / "fp32", "naive", steps=1, rollout__dtype="float32",
                                             rollout__kv_cache="false"))
    res32 = train(cfg32, model=copy.deepcopy(model), tokenizer=tok, task=varying_task())
    assert res32.history[0]["rollout_correction/k3_kl"] < res.history[0]["rollout_correction/k3_kl"]
    assert res32.history[0]["rollout_correction/k3_kl"] < 1e-9


def test_engine_lag_is_a_mismatch_only_between_syncs(tmp_path, fresh, make_overrides, varying_task):
    # fp32 engine without KV cache: μ = π_old exactly at a sync step; with sync_every=2 the engine samples step 2
    # (index 1) with the weights of before the first update, so μ ≠ π_old there, and step 3 is in sync again
    model, tok = fresh
    cfg = load_config(None, make_overrides(tmp_path, "naive", steps=3, rollout__dtype="float32",
                                           rollout__kv_cache="false", rollout__sync_every=2))
    k3 = [h["rollout_correction/k3_kl"] for h in train(cfg, model=model, tokenizer=tok, task=varying_task()).history]
    assert k3[0] < 1e-9 and k3[1] > 1e-6 and k3[2] < 1e-9


@pytest.mark.parametrize("preset, extra", [
    ("naive", {"optim__minibatches": 2}),
    ("alp", {}),
    # the engine's stale weights (synced at step 0, next at 3) are restored; torch.multinomial's draws give this
    # 4-step run non-zero advantages (the inverse-CDF draws of the same seeds give four zero-advantage steps)
    ("naive", {"rollout__sync_every": 3, "rollout__sampler": "multinomial"}),
    # an asynchronous rollout's weight history (the versions before the resume point it samples with) is restored
    ("tis", {"rollout__async_mode": "queue", "rollout__max_staleness": 2, "rollout__sampler": "multinomial"}),
    ("tis", {"rollout__async_mode": "partial", "rollout__max_staleness": 2, "rollout__sampler": "multinomial"}),
])
def test_resume_reproduces_uninterrupted_run(preset, extra, tmp_path, tiny_pair, make_overrides, varying_task):
    model0, tok = tiny_pair
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    straight = train(load_config(None, make_overrides(straight_dir, preset, steps=4, **extra)),
                     model=copy.deepcopy(model0), tokenizer=tok, task=varying_task())

    def interrupt(step, metrics):  # Ctrl-C after step 2 (as the deferred SIGINT handler would raise it)
        if step == 2:
            raise KeyboardInterrupt

    cfg = load_config(None, make_overrides(split_dir, preset, steps=4, **extra))
    first = train(cfg, model=copy.deepcopy(model0), tokenizer=tok, task=varying_task(), on_step_end=interrupt)
    assert first.interrupted and first.steps_done == 2 and first.checkpoint.name == "step_00000002.safetensors"
    # a brand-new process would rebuild everything: fresh model copy with *different* weights, then resume
    other = copy.deepcopy(model0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    second = train(cfg, model=other, tokenizer=tok, task=varying_task(), resume=True)
    assert second.steps_done == 4 and len(second.history) == 2
    losses_straight = [h["loss/loss"] for h in straight.history]
    losses_split = [h["loss/loss"] for h in first.history + second.history]
    assert losses_straight == losses_split and any(v != 0 for v in losses_straight)
    for (n, a), b in zip(straight.model.named_parameters(), second.model.parameters()):
        assert torch.equal(a, b), n
    if preset == "alp":
        assert torch.equal(straight.alp.log_sigma, second.alp.log_sigma)
    # the resumed JSONL continues the interrupted one: steps 1..4 exactly once
    assert [r["step"] for r in read_metrics(split_dir / "metrics.jsonl")] == [1, 2, 3, 4]


def test_resume_without_checkpoint_fails_before_work(tmp_path, fresh, make_overrides, varying_task):
    model, tok = fresh
    with pytest.raises(ValueError, match="resume"):
        train(load_config(None, make_overrides(tmp_path)), model=model, tokenizer=tok, task=varying_task(), resume=True)


@pytest.mark.parametrize("fail, match", [("raise", r"sample \d.*boom"), ("nan", r"sample 1 .* nan")])
def test_bad_reward_is_reported_with_the_sample(fail, match, tmp_path, fresh, make_overrides, varying_task):
    model, tok = fresh
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RewardError, match=match):
        train(load_config(None, make_overrides(tmp_path)), model=model, tokenizer=tok, task=varying_task(fail=fail))
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # no update happened


def test_exact_token_kl_hand_computed():
    # μ = softmax(log(0.5, 0.5)), π = (0.25, 0.75): KL(μ‖π) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75)
    #                                                     = 0.5·0.693147 + 0.5·(−0.405465) = 0.143841
    mu = torch.log(torch.tensor([[[0.5, 0.5]]]))
    pi = torch.log(torch.tensor([[[0.25, 0.75]]]))
    kl = exact_token_kl(mu, pi, SamplingConfig())
    assert kl.shape == (1, 1) and kl.item() == pytest.approx(0.143841, abs=1e-5)
    # identical logits → 0
    assert exact_token_kl(mu, mu, SamplingConfig()).item() == pytest.approx(0.0, abs=1e-7)
    # top_k = 1 keeps different tokens of the two (logits (1, 0) vs (0, 1)): truncating each separately would give
    # +inf and TRM would reject everything; the KL is taken between the full tempered distributions instead:
    # μ = softmax(1, 0) = (0.731059, 0.268941), π = (0.268941, 0.731059): KL = (0.731059 − 0.268941)·1 = 0.462117
    kl = exact_token_kl(torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[0.0, 1.0]]]), SamplingConfig(top_k=1))
    assert kl.item() == pytest.approx(0.462117, abs=1e-5)
    # temperature still applies: at τ = 2 the logits are (0.5, 0) / (0, 0.5): KL = (0.622459 − 0.377541)·0.5 = 0.122459
    kl = exact_token_kl(torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[0.0, 1.0]]]), SamplingConfig(temperature=2.0))
    assert kl.item() == pytest.approx(0.122459, abs=1e-5)


@pytest.mark.parametrize("extra", [
    {"algorithm__objective": "gspo", "algorithm__advantage": "rloo", "algorithm__aggregation": "seq_mean_token_mean"},
    {"algorithm__objective": "reinforce", "algorithm__advantage": "dr_grpo",
     "algorithm__aggregation": "seq_mean_token_sum_norm"},
    {"algorithm__is_level": "geometric", "algorithm__veto_threshold": "1e-4", "optim__epochs": 2},
])
def test_objectives_advantages_aggregations(extra, tmp_path, fresh, make_overrides, varying_task):
    model, tok = fresh
    preset = "mis" if "algorithm__is_level" in extra else "naive"
    before = [p.detach().clone() for p in model.parameters()]
    res = train(load_config(None, make_overrides(tmp_path, preset, steps=1, **extra)), model=model, tokenizer=tok,
                task=varying_task())
    # (GSPO + RLOO at r = 1 has loss exactly 0 — RLOO advantages sum to 0 per group — but a non-zero gradient.)
    assert math.isfinite(res.history[0]["loss/loss"]) and res.history[0]["loss/grad_norm"] > 0
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_alp_layer_subset_and_logits_only(tmp_path, fresh, make_overrides, varying_task):
    model, tok = fresh
    for layers, n in (("[1]", 1), ("logits", 1)):
        res = train(load_config(None, make_overrides(tmp_path / layers, "alp", steps=1, alp__layers=layers,
                                                     alp__level="geometric")),
                    model=model, tokenizer=tok, task=varying_task())
        assert res.alp.num_layers == n and math.isfinite(res.history[0]["loss/loss"])
        res.alp.remove()


def test_real_sigint_finishes_the_step_and_checkpoints(tmp_path, fresh, make_overrides, varying_task):
    import os
    import signal

    model, tok = fresh

    def ctrl_c(step, metrics):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)  # the deferred handler only sets a flag: the step is complete

    handler_before = signal.getsignal(signal.SIGINT)
    res = train(load_config(None, make_overrides(tmp_path, steps=3)), model=model, tokenizer=tok,
                task=varying_task(), on_step_end=ctrl_c)
    assert res.interrupted and res.steps_done == 1 and res.checkpoint.name == "step_00000001.safetensors"
    assert signal.getsignal(signal.SIGINT) is handler_before  # handler restored


# -- reusing an out_dir, resume checks, damaged files ----------------------------------------------------------------


def _runner(tmp_path, tiny_pair, make_overrides, varying_task):
    """run(preset, steps, resume=False, **overrides): a short run into tmp_path from the same initial weights."""
    model0, tok = tiny_pair

    def run(preset="naive", steps=2, resume=False, overwrite=False, **extra):
        cfg = load_config(None, make_overrides(tmp_path, preset, steps=steps, **extra))
        return train(cfg, model=copy.deepcopy(model0), tokenizer=tok, task=varying_task(), resume=resume,
                     overwrite=overwrite)

    return run


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_overwriting_run_replaces_an_earlier_run_in_its_out_dir(tmp_path, tiny_pair, make_overrides, varying_task):
    # Expected: an overwriting run into a folder holding an earlier run removes that run's checkpoints (and killed-save
    # leftovers, and TensorBoard event files) with one warning naming the folder: with only metrics.jsonl emptied, a
    # later --resume would continue the *earlier* run's step-4 checkpoint (metrics steps [1, 2, 3, 5]).
    from offpolicy.train.run_folder import RunReplacedWarning

    run = _runner(tmp_path, tiny_pair, make_overrides, varying_task)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunReplacedWarning)  # a new folder: nothing to replace, no warning
        run("mis", 4, run__checkpoint_every=1)
    ckpt, tb = tmp_path / "checkpoints", tmp_path / "tensorboard"
    (ckpt / ".tmp_k1ll3d.safetensors").write_bytes(b"half a save")
    tb.mkdir()
    (tb / "events.out.tfevents.123.host.1.0").write_bytes(b"old run")
    with pytest.warns(RunReplacedWarning, match=re.escape(repr(str(tmp_path)))):
        run("tis", 2, overwrite=True, run__checkpoint_every=1)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000001.safetensors", "step_00000002.safetensors"]
    assert not any(tb.iterdir())
    # --resume now continues this run: one more step after its step 2, and the log holds steps 1..3 once
    res = run("tis", 3, resume=True)
    assert res.steps_done == 3 and len(res.history) == 1
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.parametrize("extra, named", [
    ({"preset": "tis"}, "algorithm.preset is 'tis' here but 'mis' in the checkpoint (step 2)"),
    ({"run__seed": 7}, "run.seed=0 (now 7)"),
])
def test_resume_refuses_a_checkpoint_of_another_run(extra, named, tmp_path, tiny_pair, make_overrides,
                                                    varying_task):
    # Expected: --resume checks the preset and seed stored in the checkpoint against the config and refuses,
    # naming the keys, before any file is written (never continuing a mis/seed-0 run as icepop/seed-123 silently).
    run = _runner(tmp_path, tiny_pair, make_overrides, varying_task)
    run("mis", 2)
    before = _files(tmp_path)
    with pytest.raises(ValueError, match=re.escape(named)):
        run(**{"preset": "mis", "steps": 4, "resume": True, **extra})
    assert _files(tmp_path) == before


def test_resume_when_the_checkpoint_is_at_or_past_run_steps(tmp_path, tiny_pair, make_overrides, varying_task):
    # Expected: past run.steps → an error naming run.steps; at run.steps → a warning that there is nothing to do.
    # Neither may silently do nothing (progress "4/2") and overwrite config.yaml with the smaller run.steps.
    run = _runner(tmp_path, tiny_pair, make_overrides, varying_task)
    run("naive", 3)
    before = _files(tmp_path)
    with pytest.raises(ValueError, match=r"step 3, past run\.steps=2"):
        run("naive", 2, resume=True)
    with pytest.warns(UserWarning, match=r"already at run\.steps=3; nothing to do"):
        res = run("naive", 3, resume=True)
    assert res.steps_done == 3 and res.history == [] and res.checkpoint.name == "step_00000003.safetensors"
    assert _files(tmp_path) == before


def test_resume_after_a_kill_mid_write(tmp_path, tiny_pair, make_overrides, varying_task):
    # Expected: a half-written last metrics line and a half-written checkpoint temp file (what SIGKILL leaves) do not
    # block --resume: the line is dropped with a warning naming metrics.jsonl, the temp file is removed (not a bare
    # JSON error naming no file).
    run = _runner(tmp_path, tiny_pair, make_overrides, varying_task)
    run("naive", 2)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "rollout_correction/kl": 0.00')
    (tmp_path / "checkpoints" / ".tmp_k1ll3d.safetensors").write_bytes(b"half a save")
    with pytest.warns(UserWarning, match=r"metrics\.jsonl.*last line"):
        res = run("naive", 3, resume=True)
    assert res.steps_done == 3
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))


def test_resume_from_a_corrupt_checkpoint_names_the_file(tmp_path, tiny_pair, make_overrides, varying_task):
    # Expected: ValueError naming the checkpoint, before any file is changed (was a SafetensorError traceback).
    run = _runner(tmp_path, tiny_pair, make_overrides, varying_task)
    run("naive", 2)
    ckpt = tmp_path / "checkpoints" / "step_00000002.safetensors"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    before = _files(tmp_path)
    with pytest.raises(ValueError, match=r"step_00000002\.safetensors.*cannot be read"):
        run("naive", 4, resume=True)
    assert _files(tmp_path) == before


def test_an_out_dir_that_cannot_be_created_is_named(tmp_path, fresh, make_overrides, varying_task):
    # Expected: ValueError naming run.out_dir, not a NotADirectoryError traceback.
    model, tok = fresh
    (tmp_path / "a_file").write_text("x")
    cfg = load_config(None, make_overrides(tmp_path / "a_file" / "run"))
    with pytest.raises(ValueError, match=r"run\.out_dir .*a_file/run.* cannot be created"):
        train(cfg, model=model, tokenizer=tok, task=varying_task())


def test_on_step_end_with_the_state_changes_the_corrections_and_the_learning_rate(tmp_path, fresh, make_overrides,
                                                                                  varying_task):
    # a per-step controller: after step 1 it rebuilds the chain with new parameters and lowers the learning rate
    model, tok = fresh
    seen = []

    def controller(step, metrics, state):
        seen.append((step, state.lr))
        # the step's tensors are there for a controller that fits thresholds to them (e.g. a ratio band)
        assert state.last_scored.old_logp.shape == state.last_scored.mask.shape == state.last_scored.rollout_logp.shape
        assert state.last_rollout.rewards.numel() == state.last_scored.mask.shape[0]
        if step == 1:
            state.set_corrections([{"name": "tis", "upper": 1.5}])
            state.set_lr(1e-6)

    res = train(load_config(None, make_overrides(tmp_path, "naive", steps=2)), model=model, tokenizer=tok,
                task=varying_task(), on_step_end=controller)
    assert seen == [(1, 1e-3), (2, 1e-6)]
    assert "tis/capped_frac" not in res.history[0] and "tis/capped_frac" in res.history[1]
    assert res.state.correction_specs == [{"name": "tis", "upper": 1.5}]
    with pytest.raises(ValueError, match="unknown correction 'nope'"):
        res.state.set_corrections(["nope"])
    assert res.state.correction_specs == [{"name": "tis", "upper": 1.5}]  # a bad spec changes nothing
    with pytest.raises(ValueError, match="lr"):
        res.state.set_lr(float("nan"))


@pytest.mark.parametrize("naming, key", [("swift", "rollout_correction/kl"), ("verl", "rollout_corr/kl"),
                                         ("trl", "sampling/kl")])
def test_the_trainer_writes_the_mismatch_metrics_under_the_chosen_names(naming, key, tmp_path, fresh, make_overrides,
                                                                        varying_task):
    model, tok = fresh
    cfg = load_config(None, make_overrides(tmp_path, "tis", steps=1, run__metric_naming=naming))
    train(cfg, model=model, tokenizer=tok, task=varying_task())
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert key in row and math.isfinite(row[key])
    assert "reward/mean" in row and "loss/grad_norm" in row and "correction/masked_frac" in row
