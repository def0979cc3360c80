"""The lab's paired rule (a setting with ``"rule": "paired"``, as the demo's ``quick``): each measure compared seed
by seed, hand-computed on a small sweep whose seeds differ more from each other than the presets do."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as stg

from offpolicy.lab import stats as st
from offpolicy.lab.report import setting_rule, sweep_report_stats, write_report
from offpolicy.lab.settings import get_setting

STEPS = 4  # quarter q = 1: reward first ¼ = step 1, reward last ¼ = step 4
# last-step reward per seed: the seeds differ far more than TIS from naive (ranges overlap), yet TIS is ahead in each
LAST = {
    ("naive", "none"): [0.80, 0.90, 0.85, 0.95],
    ("naive", "lag8"): [0.30, 0.50, 0.70, 0.40],
    ("tis", "lag8"): [0.35, 0.58, 0.72, 0.49],  # − naive: +0.05, +0.08, +0.02, +0.09
}
K3 = {"none": 1e-14, "lag8": 0.1}


def _rows(preset: str, mismatch: str, seed: int) -> list[dict]:
    rewards = [0.1, 0.2, 0.25, LAST[(preset, mismatch)][seed]]  # rising: no drawdown anywhere
    return [{"step": t, "reward/mean": r, "rollout_correction/k3_kl": K3[mismatch], "loss/grad_norm": 1.0,
             "correction/masked_frac": 0.0, "time/step_s": 0.5} for t, r in enumerate(rewards, 1)]


def make_sweep(out, setting: str):
    runs = []
    for (preset, mismatch), lasts in LAST.items():
        for seed in range(len(lasts)):
            d = f"runs/{preset}__{mismatch}__s{seed}"
            (out / d).mkdir(parents=True)
            (out / d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(preset, mismatch, seed)))
            runs.append({"preset": preset, "mismatch": mismatch, "seed": seed, "dir": d, "steps": STEPS})
    plan = {"presets": ["naive", "tis"], "mismatches": ["none", "lag8"], "runs": runs}
    (out / "summary.json").write_text(json.dumps({"runs": runs, "setting": setting, "plan": plan}))
    return out


def _group(lab, preset, mismatch):
    return next(g for g in lab["groups"] if (g["preset"], g["mismatch"]) == (preset, mismatch))


def test_the_demo_setting_pairs_its_seeds():
    assert get_setting("quick")["rule"] == "paired" and setting_rule("quick") == "paired"
    assert setting_rule("full") == "ranges" and setting_rule("not-a-setting") == "ranges" and setting_rule(None) == "ranges"


def test_paired_verdicts_by_hand(tmp_path):
    lab, _ = sweep_report_stats(make_sweep(tmp_path, "quick"))
    assert lab["rule"] == "paired"
    tis = _group(lab, "tis", "lag8")["versus"]["naive"]
    # reward last ¼: +0.05, +0.08, +0.02, +0.09 → all positive; Δ = median = (0.05 + 0.08) / 2 = 0.065; p = 2 / 2⁴
    c = tis["reward_last"]
    assert (c["verdict"], c["wins"], c["n"], c["rule"]) == ("higher", 4, 4, "paired")
    assert c["diff"] == pytest.approx(0.065) and c["chance"] == pytest.approx(0.125)
    assert c["range"] == pytest.approx([0.35, 0.535, 0.72]) and c["ref_range"] == pytest.approx([0.30, 0.45, 0.70])
    # the same first step, k3, gradient norm and (no) drawdown in every seed: ties, never a verdict
    for field in ("reward_first", "k3_median", "grad_norm_max", "reward_drawdown"):
        assert tis[field]["verdict"] == "within noise" and tis[field]["wins"] == 0, field
    lag = _group(lab, "naive", "lag8")["versus"]["control"]
    # 0.30 − 0.80, 0.50 − 0.90, 0.70 − 0.85, 0.40 − 0.95 = −0.50, −0.40, −0.15, −0.55: Δ = (−0.50 − 0.40) / 2
    assert lag["reward_last"]["verdict"] == "lower" and lag["reward_last"]["diff"] == pytest.approx(-0.45)
    assert lag["k3_median"]["verdict"] == "higher"  # 0.1 against 1e-14 in every seed
    assert lab["headline"].startswith(
        "Separated over seeds (3 of 10 comparisons): naive on lag8 has a lower reward last ¼ than naive on the none "
        "control in each of the 4 seeds: 0.450 [0.300–0.700] vs 0.875 [0.800–0.950] (p = 0.12);")
    assert "tis on lag8 has a higher reward last ¼ than naive on lag8 in each of the 4 seeds: 0.535 [0.350–0.720] vs " \
           "0.450 [0.300–0.700] (p = 0.12)." in lab["headline"]


def test_the_same_sweep_by_ranges(tmp_path):
    """Without pairing the seeds' spread hides TIS's lead: [0.35, 0.72] overlaps naive's [0.30, 0.70]."""
    lab, _ = sweep_report_stats(make_sweep(tmp_path, "synthetic"))
    assert lab["rule"] == "ranges"
    c = _group(lab, "tis", "lag8")["versus"]["naive"]["reward_last"]
    assert c["verdict"] == "within noise" and c["diff"] == pytest.approx(0.535 - 0.45)  # difference of the medians
    lag = _group(lab, "naive", "lag8")["versus"]["control"]["reward_last"]
    assert lag["verdict"] == "lower" and lag["chance"] == pytest.approx(2 / 70)  # 2 / C(8, 4)


def test_the_report_states_the_paired_rule(tmp_path):
    from rich.console import Console

    from offpolicy.lab.tables import rich_table

    report = write_report(make_sweep(tmp_path, "quick"))
    assert "seed by seed" in report.table.read_text() and "2/2ⁿ" in report.table.read_text()
    page = report.html.read_text()
    assert "seed by seed" in page and "p = 2 / 2ⁿ" in page
    console = Console(width=200, record=True)
    console.print(rich_table(report.stats, title="offpolicy demo"))
    text = console.export_text()
    assert "higher (or lower) in every seed" in text and "p = 0.12" in text
    assert "reward last ↑" in text


def test_a_seed_missing_on_one_side_is_left_out(tmp_path):
    out = make_sweep(tmp_path, "quick")
    summary = json.loads((out / "summary.json").read_text())
    summary["runs"] = [r for r in summary["runs"] if (r["preset"], r["seed"]) != ("tis", 2)]
    (out / "summary.json").write_text(json.dumps(summary))
    lab, _ = sweep_report_stats(out)
    c = _group(lab, "tis", "lag8")["versus"]["naive"]["reward_last"]
    assert (c["n"], c["wins"], c["chance"]) == (3, 3, 0.25)  # seeds 0, 1, 3: +0.05, +0.08, +0.09
    assert c["diff"] == pytest.approx(0.08)


def test_compare_paired_edges():
    assert st.compare_paired([0.1], [0.2], "x")["verdict"] == "too few seeds"
    c = st.compare_paired([0.3, float("nan"), 0.5, None], [0.2, 0.1, 0.4, 0.1], "x")  # seeds 1 and 3 left out
    assert (c["n"], c["verdict"], c["wins"]) == (2, "higher", 2) and c["chance"] == 0.5
    with pytest.raises(ValueError, match="compare_paired: 2 values against 3 reference values"):
        st.compare_paired([0.1, 0.2], [0.1, 0.2, 0.3], "x")
    with pytest.raises(ValueError, match="rule must be one of"):
        st.sweep_stats([], {}, [], [], rule="rank")


@pytest.mark.parametrize("n", range(1, 9))
def test_the_chance_is_the_sign_flip_count(n):
    """Under no difference each pair's sign is a fair coin: 2 of the 2ⁿ sign patterns agree everywhere."""
    agree = sum(len(set(p)) == 1 for p in itertools.product((-1, 1), repeat=n))
    assert st.chance_of_same_sign(n) == pytest.approx(agree / 2**n)


pairs = stg.lists(stg.tuples(stg.integers(-50, 50), stg.integers(-50, 50)), min_size=2, max_size=10)


@given(pairs)
def test_swapping_the_groups_swaps_the_verdict(ps):
    a, b = [float(x) for x, _ in ps], [float(y) for _, y in ps]
    forward, back = st.compare_paired(a, b, "x"), st.compare_paired(b, a, "x")
    assert {forward["verdict"], back["verdict"]} in ({"within noise"}, {"higher", "lower"})
    assert forward["diff"] == -back["diff"]


@given(pairs, stg.lists(stg.integers(-1000, 1000), min_size=10, max_size=10))
def test_a_shared_seed_offset_changes_nothing(ps, offsets):
    """What one seed does to both groups (an easier prompt set) cancels in the pair; integers keep it exact."""
    a, b = [float(x) for x, _ in ps], [float(y) for _, y in ps]
    moved = st.compare_paired([x + o for x, o in zip(a, offsets)], [y + o for y, o in zip(b, offsets)], "x")
    plain = st.compare_paired(a, b, "x")
    assert (moved["verdict"], moved["wins"], moved["diff"]) == (plain["verdict"], plain["wins"], plain["diff"])


@given(pairs)
def test_separated_exactly_when_every_seed_agrees(ps):
    a, b = [float(x) for x, _ in ps], [float(y) for _, y in ps]
    c = st.compare_paired(a, b, "x")
    assert (c["verdict"] == "higher") == all(x > y for x, y in zip(a, b))
    assert (c["verdict"] == "lower") == all(x < y for x, y in zip(a, b))
    assert c["chance"] == 2 / 2 ** len(ps) and c["wins"] == sum(x > y for x, y in zip(a, b))


def test_the_per_seed_figure_joins_each_seed(tmp_path, monkeypatch):
    """final_reward.png under the paired rule: one grey line per seed from naive's dot to TIS's on lag8 (4 seeds);
    under the ranges rule no line."""
    from offpolicy.lab import plots

    drawn = {}
    real = plots.save_figure

    def keep(plt, fig, path, **kw):
        drawn[path.name] = [line.get_ydata().tolist() for ax in fig.axes for line in ax.lines
                            if line.get_color() == "0.6"]
        return real(plt, fig, path, **kw)

    monkeypatch.setattr(plots, "save_figure", keep)
    write_report(make_sweep(tmp_path / "paired", "quick"))
    assert sorted(drawn["final_reward.png"]) == sorted(
        [[n, t] for n, t in zip(LAST[("naive", "lag8")], LAST[("tis", "lag8")])])
    write_report(make_sweep(tmp_path / "ranges", "synthetic"))
    assert drawn["final_reward.png"] == []
