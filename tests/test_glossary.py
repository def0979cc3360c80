"""Every metric the library logs has a glossary entry (src/offpolicy/glossary.py → docs/metrics.md): the
diagnostics under every framework's names, each correction's and objective's metrics, ``report.json``'s numeric keys,
and what the trainer writes at a step of every preset (with the controllers on). The TRL and verl adapters' keys are
checked where those adapters run: tests/test_quickstarts.py."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

import offpolicy as op
from offpolicy.glossary import DIAGNOSTICS, ENTRIES, IS_NAMES, KL_MODES, RENAMED, lookup
from offpolicy.metrics import METRIC_NAMES, NAMINGS
from offpolicy.registry import CORRECTIONS, OBJECTIVES, build_correction

# corrections whose factory has required parameters: one example each
EXAMPLES = {"importance": {"level": "token", "mode": "truncate", "upper": 2.0},
            "kl_rejection": {"mode": "seq_max_k2", "upper": 0.1}}


def _batch() -> op.LogProbBatch:
    g = torch.Generator().manual_seed(0)
    mu = -torch.rand(4, 5, generator=g)
    old = mu + 0.3 * torch.randn(4, 5, generator=g)
    return op.LogProbBatch(logp=old.clone().requires_grad_(), old_logp=old, rollout_logp=mu, mask=torch.ones(4, 5),
                           advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))


def unknown(keys) -> list[str]:
    return sorted(k for k in keys if lookup(k) is None)


def test_every_diagnostic_has_a_definition():
    assert set(DIAGNOSTICS) == set(METRIC_NAMES)


def test_every_report_json_metric_has_an_entry():
    from offpolicy.inspect.gate import REPORT_METRICS

    assert unknown(f"inspect:{k}" for k in REPORT_METRICS) == []


def test_the_entries_are_distinct_and_filled():
    keys = [e.key for e in ENTRIES]
    assert len(keys) == len(set(keys))
    assert all(e.means and e.logged_by for e in ENTRIES)


def test_diagnostics_under_every_naming_are_known():
    b = _batch()
    for naming in NAMINGS:
        assert unknown(op.offpolicy_metrics(b.old_logp, b.rollout_logp, b.mask, naming=naming)) == [], naming


@pytest.mark.parametrize("name", CORRECTIONS.names())
def test_every_corrections_metrics_are_known(name):
    result = build_correction({"name": name, **EXAMPLES.get(name, {})})(_batch())
    assert unknown(result.metrics) == []


@pytest.mark.parametrize("name", OBJECTIVES.names())
def test_every_objectives_metrics_are_known(name):
    _, metrics = op.policy_loss(_batch(), objective=name)
    assert unknown(metrics) == []


TINY = "{num_hidden_layers: 2, hidden_size: 32, intermediate_size: 64, num_attention_heads: 2, num_key_value_heads: 1}"
CONTROLLERS = {"trm": ["control.trm_acceptance=0.7"], "mis": ["control.is_max_masked=0.05"],
               "naive": ["control.lr_guard=true"], "alp": ["alp.enabled=true"],
               "alp_score_centering": ["alp.enabled=true"], "alp_score_centering_topk": ["alp.enabled=true"]}


@pytest.mark.slow  # one step of each of the 19 presets on a random 2-layer model: ~25 s on 2 cores
def test_every_key_the_trainer_logs_is_known():
    from offpolicy.train import load_config, train
    from offpolicy.train.presets import PRESETS

    seen: set[str] = set()
    for preset in PRESETS:
        with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = load_config(None, [
                f"algorithm.preset={preset}", "model.path=tiny-random", f"model.tiny_config={TINY}", "run.steps=1",
                f"run.out_dir={out}", "run.progress=false", "run.tensorboard=false", "task.prompts_per_step=2",
                "algorithm.group_size=2", "rollout.sampling.max_new_tokens=4", *CONTROLLERS.get(preset, [])])
            seen |= set(train(cfg).history[0])
    assert unknown(seen) == []
    assert {"alp/sigma_mean", "control/trm_max_kl", "dvp/mass_min", "trm/masked_seq_frac"} <= seen  # the runs covered them


def test_every_metric_the_guide_names_is_in_the_glossary():
    # docs/choosing.md quotes metric names per framework: each must be a key the glossary explains
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "choosing.md").read_text(encoding="utf-8")
    rows = [line for line in page.splitlines() if line.startswith("| metric |")]
    keys = [k for line in rows for k in re.findall(r"`([^`]+)`", line)]
    trl_own = {"grad_norm"}  # TRL's and ms-swift's own (the HF Trainer's) gradient norm
    assert len(keys) > 10 and unknown(k for k in keys if k not in trl_own) == []


def _instances(name: str) -> list[str]:
    """A renamed-table name with its placeholder filled in every way (``<is>/x`` → ``tis/x``, ``mis/x``, …)."""
    for placeholder, names in (("<is>", IS_NAMES), ("<kl_mode>", KL_MODES)):
        if placeholder in name:
            return [name.replace(placeholder, n) for n in names]
    return [name]


def test_no_correction_logs_a_renamed_metric_and_every_new_name_is_known():
    import re

    name = re.compile(r"[<\w>]+(?:/\w+)+")
    logged: set[str] = set()
    for correction in CORRECTIONS.names():
        spec = {"name": correction, **EXAMPLES.get(correction, {})}
        logged |= set(op.chain(build_correction(spec))(_batch()).metrics)
    for mode in KL_MODES:
        logged |= set(op.kl_rejection(mode, upper=0.1)(_batch()).metrics)
    assert len(RENAMED) >= 10
    for old, new in RENAMED:
        gone = set(_instances(name.findall(old)[0]))
        replacements = [k for found in name.findall(new) for k in _instances(found)]
        if not gone & set(replacements):  # a name kept with a new meaning (kept_frac) is still logged
            assert not gone & logged, old
        assert replacements and unknown(replacements) == [], new
        assert all(k in logged for k in replacements), new  # what says it now is logged
