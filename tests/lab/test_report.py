"""The lab report on a hand-made sweep with known numbers, its statistics, damaged inputs and a browser rendering."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import warnings

import pytest

from offpolicy.lab import stats as st
from offpolicy.lab.report import sweep_report_stats, write_report

STEPS = 8  # quarter q = 8 // 4 = 2 steps
# last-quarter rewards per (preset, mismatch): each seed's last two steps (their mean is the last-quarter reward)
LAST = {
    ("naive", "none"): [(0.6, 0.6), (0.7, 0.7), (0.7, 0.9)],  # → 0.6, 0.7, 0.8
    ("naive", "bf16"): [(0.3, 0.3), (0.4, 0.4), (0.5, 0.5)],  # → 0.3, 0.4, 0.5
    ("mis", "none"): [(0.65, 0.65), (0.7, 0.7), (0.75, 0.75)],  # → 0.65, 0.7, 0.75
    ("mis", "bf16"): [(0.5, 0.6), (0.7, 0.7), (0.72, 0.72)],  # → 0.55, 0.7, 0.72
}
K3_SLOPE = {("naive", "bf16"): [0.5, 0.3, 0.1], ("mis", "bf16"): [0.0, 0.05, -0.05]}  # d ln k3 / d step per seed


def _rows(preset: str, mismatch: str, seed: int) -> list[dict]:
    rows = []
    for t in range(1, STEPS + 1):
        k = t - 1
        reward = {1: 0.1 if (preset, mismatch, seed) == ("naive", "none", 0) else 0.2,
                  2: 0.3 if (preset, mismatch, seed) == ("naive", "none", 0) else 0.2}.get(t, 0.4)
        if t > STEPS - 2:
            reward = LAST[(preset, mismatch)][seed][t - (STEPS - 1)]
        if mismatch == "none":
            k3 = (1 + k) * 1e-14  # fp32 rounding: below the 1e-10 floor of the trend fit
        else:
            k3 = 1e-3 * math.exp(K3_SLOPE[(preset, mismatch)][seed] * k)
        grad = float(t)
        if (preset, mismatch, seed) == ("naive", "bf16", 0):
            grad = 50.0 if t == STEPS else 1.0  # one spike
        if (preset, mismatch, seed) == ("naive", "none", 1) and t == 4:
            grad = None  # a non-finite value, logged as null by the trainer
        masked = 0.0
        if (preset, mismatch) == ("mis", "bf16"):
            masked = [0.1, (0.0, 0.2)[k % 2], 0.3][seed]
        rows.append({
            "step": t, "reward/mean": reward, "rollout_correction/k3_kl": k3, "loss/grad_norm": grad,
            "correction/masked_frac": masked,
            "rollout_correction/log_ppl_abs_diff": 0.01 * t if mismatch == "bf16" else 0.0,
            "mismatch/token_kl_exact_mean": 2e-3 if (preset, mismatch, seed) == ("mis", "bf16", 0) else None,
            "response/length_mean": 30.0 if (preset, mismatch, seed) == ("mis", "none", 2) else 32.0,
            "time/step_s": 0.5, "rollout_correction/kl": -1.0,
        })
    return rows


def make_sweep(out):
    runs = []
    for preset in ("naive", "mis"):
        for mismatch in ("none", "bf16"):
            for seed in range(3):
                d = f"runs/{preset}__{mismatch}__s{seed}"
                (out / d).mkdir(parents=True)
                (out / d / "metrics.jsonl").write_text(
                    "".join(json.dumps(r) + "\n" for r in _rows(preset, mismatch, seed)))
                runs.append({"preset": preset, "mismatch": mismatch, "seed": seed, "dir": d, "steps": STEPS})
    plan = {"presets": ["naive", "mis"], "mismatches": ["none", "bf16"], "runs": runs, "overrides": ["x=1"]}
    (out / "summary.json").write_text(json.dumps({"runs": runs, "setting": "synthetic", "plan": plan}))
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = make_sweep(tmp_path_factory.mktemp("sweep"))
    return write_report(out)


def _group(stats, preset, mismatch):
    return next(g for g in stats["groups"] if (g["preset"], g["mismatch"]) == (preset, mismatch))


def test_per_run_numbers(report):
    runs = json.loads(report.stats_path.read_text())["runs"]
    r = runs["runs/naive__none__s0"]
    assert r["steps"] == 8 and r["quarter"] == 2
    assert r["reward_first"] == pytest.approx(0.2)  # (0.1 + 0.3) / 2
    assert r["reward_last"] == pytest.approx(0.6)  # (0.6 + 0.6) / 2
    assert r["reward_gain"] == pytest.approx(0.4)
    assert r["reward_drawdown"] == 0.0  # 0.1, 0.3, 0.4 … 0.6, 0.6: the 3-step mean only rises
    # naive / bf16 seed 0 ends 0.4, 0.4, 0.3, 0.3: 3-step means … 0.4, 0.4, 0.367, 0.333 → fell 0.4 − 0.333
    bf16 = runs["runs/naive__bf16__s0"]
    assert bf16["reward_drawdown"] == pytest.approx(0.4 - 1.0 / 3)
    assert runs["runs/naive__bf16__s1"]["reward_drawdown"] == 0.0
    assert r["k3_median"] == pytest.approx(4.5e-14)  # k3 = 1e-14 … 8e-14: (4e-14 + 5e-14) / 2
    assert r["k3_slope_per_100"] == 0.0 and r["k3_change"] == 1.0  # every value below the floor: ln(1e-10) each
    assert r["grad_norm_median"] == pytest.approx(4.5)  # 1 … 8: (4 + 5) / 2
    assert r["grad_norm_p95"] == pytest.approx(7.65)  # position 0.95 · 7 = 6.65: 7 + 0.65 · (8 − 7)
    assert r["grad_norm_max"] == 8.0
    assert r["exact_kl_median"] is None and r["nonfinite"] == {}

    spike = runs["runs/naive__bf16__s0"]  # grad 1 × 7, then 50
    assert spike["grad_norm_median"] == 1.0 and spike["grad_norm_max"] == 50.0
    assert spike["grad_norm_p95"] == pytest.approx(32.85)  # 1 + 0.65 · (50 − 1)
    assert spike["k3_slope_per_100"] == pytest.approx(50.0)  # ln k3 rises 0.5 per step
    assert spike["k3_change"] == pytest.approx(math.exp(3.5))  # 0.5 · (8 − 1) = 3.5 → ×33.1
    assert spike["k3_median"] == pytest.approx(1e-3 * (math.exp(1.5) + math.exp(2.0)) / 2)  # 5.935e-3
    assert spike["ppl_gap_median"] == pytest.approx(0.045)  # 0.01 … 0.08: (0.04 + 0.05) / 2

    gap = runs["runs/naive__none__s1"]  # grad 1, 2, 3, null, 5, 6, 7, 8
    assert gap["nonfinite"] == {"loss/grad_norm": 1}
    assert gap["grad_norm_median"] == 5.0  # 7 finite values: the 4th, 5
    assert gap["grad_norm_p95"] == pytest.approx(7.7)  # position 0.95 · 6 = 5.7: 7 + 0.7 · (8 − 7)

    assert runs["runs/mis__bf16__s1"]["masked_frac_mean"] == pytest.approx(0.1)  # 0, 0.2, 0, 0.2 …
    assert runs["runs/mis__bf16__s0"]["exact_kl_median"] == pytest.approx(2e-3)


def test_group_spreads_and_verdicts(report):
    stats = json.loads(report.stats_path.read_text())
    assert [(g["preset"], g["mismatch"]) for g in stats["groups"]] == [
        ("naive", "none"), ("naive", "bf16"), ("mis", "none"), ("mis", "bf16")]

    g = _group(stats, "naive", "none")
    assert g["reward_last"] == pytest.approx({"median": 0.7, "min": 0.6, "max": 0.8, "n": 3})
    assert g["reward_gain"]["median"] == pytest.approx(0.5)  # gains 0.4, 0.5, 0.6
    assert g["vs_control"] is None and g["vs_naive"] is None

    g = _group(stats, "naive", "bf16")
    assert g["grad_norm_max"] == {"median": 8.0, "min": 8.0, "max": 50.0, "n": 3}
    assert g["grad_norm_p95"] == pytest.approx({"median": 7.65, "min": 7.65, "max": 32.85, "n": 3})
    # slopes 0.5, 0.3, 0.1 per step (all > 0); changes e^3.5 = 33.1, e^2.1 = 8.17, e^0.7 = 2.01: median 8.17 ≥ 2
    assert g["mismatch_trend"]["trend"] == "growing" and g["mismatch_trend"]["verdict"] == "growing"
    assert g["mismatch_trend"]["change"]["median"] == pytest.approx(math.exp(2.1))
    assert g["mismatch_trend"]["slope_per_100"]["median"] == pytest.approx(30.0)
    # vs control (naive, none): medians 0.4 − 0.7 = −0.3; ranges [0.3, 0.5] and [0.6, 0.8] do not overlap
    c = g["vs_control"]
    assert c["diff"] == pytest.approx(-0.3) and c["verdict"] == "lower" and c["within_noise"] is False
    assert c["chance"] == pytest.approx(0.1)  # 2 / C(6, 3) = 2 / 20

    g = _group(stats, "mis", "bf16")
    # slopes 0, 0.05, −0.05: not all positive → flat; changes 1, e^0.35, e^−0.35: median 1
    assert g["mismatch_trend"]["trend"] == "flat" and g["mismatch_trend"]["verdict"] == "bounded"
    assert g["mismatch_trend"]["change"]["median"] == pytest.approx(1.0)
    assert g["masked_frac_mean"] == pytest.approx({"median": 0.1, "min": 0.1, "max": 0.3, "n": 3})
    assert g["exact_kl_median"] == pytest.approx({"median": 2e-3, "min": 2e-3, "max": 2e-3, "n": 1})
    # vs naive (bf16): 0.7 − 0.4 = +0.3, ranges [0.55, 0.72] and [0.3, 0.5] apart → higher
    assert g["vs_naive"]["diff"] == pytest.approx(0.3) and g["vs_naive"]["verdict"] == "higher"
    # vs control (mis, none): 0.7 − 0.7 = 0; ranges [0.55, 0.72] and [0.65, 0.75] overlap on [0.65, 0.72]
    assert g["vs_control"]["diff"] == pytest.approx(0.0, abs=1e-12)
    assert g["vs_control"]["verdict"] == "within noise" and g["vs_control"]["within_noise"] is True

    g = _group(stats, "mis", "none")
    assert g["length_mean"] == {"median": 32.0, "min": 30.0, "max": 32.0, "n": 3}
    assert g["vs_naive"]["verdict"] == "within noise"  # [0.65, 0.75] inside [0.6, 0.8]
    assert stats["complete"] is True and stats["missing"] == [] and stats["step_s_median"] == 0.5


def test_markdown_table(report):
    text = report.table.read_text()
    assert "each cell: median [min–max] over seeds" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| naive | bf16 | 3 |"))
    assert "| 0.200 [0.200–0.200] | 0.400 [0.300–0.500] |" in row
    assert "| 8 [8–50] |" in row  # gradient-norm maximum
    # one verdict row per comparison, a cell per measure: reward first ¼, last ¼, drawdown, ‖∇‖ max, k3 KL
    verdict = next(ln for ln in text.splitlines() if ln.startswith("| naive | bf16 | naive, none |"))
    cells = [c.strip() for c in verdict.strip("|").split("|")]
    assert cells[3:] == [
        "+0.000 within noise",  # first ¼: 0.2 everywhere except naive/none s0 (0.2 too: (0.1 + 0.3) / 2)
        "-0.300 lower (p = 0.1)",  # last ¼: 0.4 [0.3–0.5] vs 0.7 [0.6–0.8]
        "+0.000 within noise",  # drawdown: 0.067 [0–0.067] vs 0 [0–0]: they touch at 0
        "+0 within noise",  # ‖∇‖ max 8 [8–50] vs 8 [8–8]
        "+2.89e-03 higher (p = 0.1)",  # k3: 2.89e-3 [1.42e-3–5.94e-3] vs 4.5e-14 [4.5e-14–4.5e-14]
        "×8.2 [×2–×33]", "growing"]
    rows = [ln for ln in text.splitlines() if ln.startswith("| mis | bf16 |")]
    assert [r.split("|")[3].strip() for r in rows] == ["3", "naive, bf16", "mis, none"]  # numbers, 2 verdict rows
    assert "+0.300 higher (p = 0.1)" in rows[1] and "bounded (flat)" in rows[1]
    # k3 of mis/bf16 (medians 1.00e-3) against naive/bf16 (2.89e-3): 1.19e-3 < 1.42e-3, apart
    assert "-1.89e-03 lower (p = 0.1)" in rows[1]
    assert "+0.000 within noise" in rows[2]  # last ¼ 0.7 [0.55–0.72] vs 0.7 [0.65–0.75]
    assert "| naive | none | – | – | – | – | – | – | – | (control) |" in text
    assert "rollout_correction/kl" not in text  # the signed estimator is never reported


def test_headline_names_every_separated_comparison(report):
    stats = json.loads(report.stats_path.read_text())
    found = [(f["preset"], f["mismatch"], f["versus"], f["field"], f["verdict"]) for f in stats["separated"]]
    assert found == [  # 5 of the 20 comparisons (naive/bf16: 1 × 5, mis/none: 1 × 5, mis/bf16: 2 × 5)
        ("naive", "bf16", "control", "reward_last", "lower"), ("naive", "bf16", "control", "k3_median", "higher"),
        ("mis", "bf16", "naive", "reward_last", "higher"), ("mis", "bf16", "naive", "k3_median", "lower"),
        ("mis", "bf16", "control", "k3_median", "higher")]
    assert [f["better"] for f in stats["separated"]] == [False, False, True, True, False]
    head = stats["headline"]
    assert head.startswith("Separated over seeds (5 of 20 comparisons): naive on bf16 has a lower reward last ¼ "
                           "than naive on the none control: 0.400 [0.300–0.500] vs 0.700 [0.600–0.800] (p = 0.1);")
    assert "mis on bf16 has a lower k3 KL than naive on bf16: 1.00e-03 [8.40e-04–1.19e-03] vs" in head
    assert head in report.table.read_text()
    assert "Separated over seeds (5 of 20 comparisons)" in report.html.read_text()


def test_headline_when_nothing_separates():
    from offpolicy.lab.tables import headline

    c = st.compare([0.1, 0.3], [0.2, 0.4], "naive, x")  # overlap on [0.2, 0.3]
    group = {"preset": "tis", "mismatch": "x", "versus": {"naive": {"reward_last": c}}}
    assert headline({"groups": [group]}) == ("No measure separates over the seeds: all 1 comparisons (against naive "
                                              "and against the control) are within noise.")


def test_the_masked_fraction_is_drawn_only_when_something_masked(tmp_path):
    out = make_sweep(tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    summary["runs"] = [r for r in summary["runs"] if r["preset"] == "naive"]  # mis/bf16 is the one that masks
    summary["plan"]["presets"] = ["naive"]
    (out / "summary.json").write_text(json.dumps(summary))
    rep = write_report(out)
    assert [p.name for p in rep.plots] == ["overview.png", "reward.png", "k3_kl.png", "grad_norm.png",
                                           "final_reward.png"]
    assert "Masked / dropped token fraction" not in rep.html.read_text()
    import matplotlib.image

    # the overview has three rows of panels (reward, k3, gradient norm), not four: 2.7 in per row + 1 in, at 90 dpi
    assert matplotlib.image.imread(rep.out / "plots" / "overview.png").shape[0] < 90 * (2.7 * 3 + 1.0) + 10


def test_html_is_self_contained(report):
    page = report.html.read_text()
    assert page.count("data:image/png;base64,") == len(report.plots) == 6
    assert "src=\"http" not in page and "src='http" not in page and ".png\"" not in page
    for text in ("within noise", "median [min–max] over seeds", "naive__bf16__s0", "growing", "Definitions"):
        assert text in page
    names = sorted(p.name for p in (report.out / "plots").glob("*.png"))
    assert names == ["final_reward.png", "grad_norm.png", "k3_kl.png", "masked_frac.png", "overview.png",
                     "reward.png"]
    assert all(p.stat().st_size > 10_000 for p in report.plots)


def test_small_statistics():
    assert st.quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert st.quantile([1.0, 2.0], 0.95) == pytest.approx(1.95)  # 1 + 0.95 · (2 − 1)
    assert st.quantile([None, math.nan], 0.5) is None
    assert st.ls_slope([1, 2, 3, 4], [2.0, 2.0, 2.0, 2.0]) == 0.0 and st.ls_slope([1], [1.0]) is None
    assert st.chance_of_separation(2, 2) == pytest.approx(1 / 3)  # 2 / C(4, 2) = 2 / 6
    assert st.chance_of_separation(5, 5) == pytest.approx(2 / 252)

    def seeds(*slopes):  # per-run trend numbers over a 101-step run: change = e^(slope · 100 / 100)
        return [{"k3_slope_per_100": s, "k3_change": math.exp(s)} for s in slopes]

    assert st.mismatch_trend(seeds(-1.0, -0.8, -2.0))["trend"] == "falling"  # changes e^-1 = 0.37 … ≤ 0.5
    assert st.mismatch_trend(seeds(-0.1, -0.2, -2.0))["trend"] == "flat"  # falling everywhere, median ×0.82 > ×0.5
    assert st.mismatch_trend(seeds(0.5, 0.6, 0.9))["trend"] == "flat"  # rising in every seed but median ×1.8 < ×2
    assert st.mismatch_trend(seeds(0.5, 0.7, 0.9))["trend"] == "growing"  # median ×e^0.7 = ×2.01
    assert st.mismatch_trend(seeds(0.8, -0.1, 0.9))["trend"] == "flat"  # one seed falls
    assert st.compare([0.1], [0.2, 0.3], "x")["verdict"] == "too few seeds"
    c = st.compare([0.1, 0.2], [0.2, 0.3], "x")  # ranges touch at 0.2: they overlap
    assert c["verdict"] == "within noise" and c["diff"] == pytest.approx(-0.1)


@pytest.mark.parametrize("damage, message", [
    ("missing", r"run folder '.*runs/mis__bf16__s2' has no metrics\.jsonl"),
    ("folder", r"run folder '.*runs/mis__bf16__s2' does not exist"),
    ("middle", r"metrics file '.*runs/mis__bf16__s2/metrics\.jsonl', line 3: not a JSON record"),
    ("field", r"metrics file '.*runs/mis__bf16__s2/metrics\.jsonl', step 5: no 'loss/grad_norm' field"),
    ("type", r"metrics file '.*runs/mis__bf16__s2/metrics\.jsonl', step 2: 'reward/mean' is 'high', not a number"),
    ("empty", r"metrics file '.*runs/mis__bf16__s2/metrics\.jsonl' has no logged steps"),
    ("order", r"metrics file '.*runs/mis__bf16__s2/metrics\.jsonl', record 3: 'step' is 2, expected an int > 2"),
])
def test_damaged_run_named_in_one_line(tmp_path, damage, message):
    out = make_sweep(tmp_path)
    path = out / "runs/mis__bf16__s2/metrics.jsonl"
    lines = path.read_text().splitlines()
    if damage == "missing":
        path.unlink()
    elif damage == "folder":
        shutil.rmtree(path.parent)
    elif damage == "middle":
        path.write_text("\n".join([*lines[:2], lines[2][:30], *lines[3:]]) + "\n")
    elif damage == "field":
        row = json.loads(lines[4])
        del row["loss/grad_norm"]
        path.write_text("\n".join([*lines[:4], json.dumps(row), *lines[5:]]) + "\n")
    elif damage == "type":
        row = json.loads(lines[1])
        row["reward/mean"] = "high"
        path.write_text("\n".join([lines[0], json.dumps(row), *lines[2:]]) + "\n")
    elif damage == "empty":
        path.write_text("")
    elif damage == "order":
        path.write_text("\n".join([lines[0], lines[1], lines[1], *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match=message) as err:
        write_report(out)
    assert "\n" not in str(err.value)


def test_half_written_last_line_is_skipped_with_a_warning(tmp_path):
    out = make_sweep(tmp_path)
    path = out / "runs/naive__none__s0/metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 9, "reward/me')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats, _ = sweep_report_stats(out)
    assert any("ignoring its last line 9" in str(w.message) for w in caught)
    assert stats["runs"]["runs/naive__none__s0"]["steps"] == 8


def test_missing_summary_and_unfinished_runs(tmp_path):
    with pytest.raises(ValueError, match=r"'.*summary\.json' does not exist: no sweep in"):
        write_report(tmp_path)
    out = make_sweep(tmp_path / "s")
    summary = json.loads((out / "summary.json").read_text())
    failed = summary["runs"].pop()  # mis / bf16 / seed 2 failed: it leaves the table, the report names it
    summary["failed"] = [{**failed, "error": "error: boom"}]
    (out / "summary.json").write_text(json.dumps(summary))
    stats, _ = sweep_report_stats(out)
    assert stats["complete"] is False
    assert stats["missing"] == [{**failed, "status": "failed", "error": "error: boom"}]
    assert _group(stats, "mis", "bf16")["seeds"] == [0, 1]


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(_chromium() is None, reason="no chromium installed")
def test_report_renders_in_headless_chromium(report, tmp_path):
    shot = tmp_path / "report.png"
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
           f"--screenshot={shot}", "--window-size=1280,3000", report.html.resolve().as_uri()]
    subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    assert shot.is_file(), "chromium wrote no screenshot"
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (3000, 1280)
    assert pixels[..., :3].std() > 0.05  # tables and figures, not a blank page


@pytest.mark.skipif(_chromium() is None, reason="no chromium installed")
def test_tables_fit_a_1400_px_window(report, tmp_path):
    # chromium prints the document's width in its title, read back from --dump-dom
    page = tmp_path / "page.html"
    script = ("<script>window.onload = () => { document.title = 'W' + document.documentElement.scrollWidth + "
              "'x' + document.documentElement.clientWidth; };</script>")
    page.write_text(report.html.read_text().replace("</body>", script + "</body>"))
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
           "--window-size=1400,2000", "--virtual-time-budget=5000", "--dump-dom", page.resolve().as_uri()]
    dom = subprocess.run(cmd, capture_output=True, timeout=120, check=False, text=True).stdout
    import re

    found = re.search(r"<title>W(\d+)x(\d+)</title>", dom)
    assert found, "chromium dumped no measured title"
    scroll, inner = map(int, found.groups())
    assert scroll <= inner, f"the page is {scroll} px wide in a {inner} px window: a table overflows"


def test_controller_thresholds_get_their_figure(tmp_path):
    out = make_sweep(tmp_path)
    for seed in range(3):  # mis on bf16 ran with a controller that widened its band from 2.0 by 0.1 per step
        f = out / f"runs/mis__bf16__s{seed}/metrics.jsonl"
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        f.write_text("".join(json.dumps({**r, "control/is_upper": 2.0 + 0.1 * r["step"]}) + "\n" for r in rows))
    rep = write_report(out)
    assert [p.name for p in rep.plots][-1] == "controls.png" and len(rep.plots) == 7
    page = rep.html.read_text()
    assert "Closed-loop control: thresholds per step" in page and page.count("data:image/png;base64,") == 7


def test_a_variant_is_drawn_seed_by_seed_beside_its_preset(tmp_path):
    out = make_sweep(tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    for seed in range(3):  # mis_band (mis with a controller) ran on bf16 too
        src, dst = f"runs/mis__bf16__s{seed}", f"runs/mis_band__bf16__s{seed}"
        shutil.copytree(out / src, out / dst)
        summary["runs"].append({"preset": "mis_band", "mismatch": "bf16", "seed": seed, "dir": dst, "steps": STEPS})
    summary["plan"]["presets"].append("mis_band")
    (out / "summary.json").write_text(json.dumps(summary))
    rep = write_report(out)
    assert "variants.png" in [p.name for p in rep.plots]
    assert "Controllers beside their fixed-threshold presets, seed by seed" in rep.html.read_text()
    # the synthetic sweep of the other tests has no variant: no such figure there
    assert "variants.png" not in [p.name for p in write_report(make_sweep(tmp_path / "plain")).plots]
