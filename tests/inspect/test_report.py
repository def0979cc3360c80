"""The report: stable report.json keys, PNGs, a self-contained HTML — and what a person sees in a browser."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import tempfile

import pytest
import torch

from offpolicy.inspect.figures import FIGURES
from offpolicy.inspect.measurements import Measurements, TokenData
from offpolicy.inspect.report import markdown_table, write_report
from offpolicy.inspect.run import inspect_engines
from offpolicy.inspect.specs import ROLLOUT_SPECS, TRAINER_SPECS
from offpolicy.rollout.sampling import SamplingConfig

STABLE_KEYS = ("kl_mean", "kl_max", "tv_mean", "tail_head_ratio", "layers", "first_divergent_layer", "recommended")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report(sharp, prompts, tmp_path_factory):
    model, tok = sharp
    measured = inspect_engines(model, prompts * 2, ROLLOUT_SPECS["w8kv8"], TRAINER_SPECS["fp32"],
                               SamplingConfig(max_new_tokens=12), tokenizer=tok, ignore_eos=True)
    out = tmp_path_factory.mktemp("report")
    return measured, write_report(measured, out), out


def test_report_json_has_the_stable_keys(report):
    measured, summary, out = report
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk == summary
    for key in STABLE_KEYS:
        assert key in on_disk
    t = measured.tokens
    assert on_disk["kl_mean"] == pytest.approx(float(t.kl[t.mask].double().mean()))
    assert on_disk["kl_max"] == pytest.approx(float(t.kl[t.mask].max()))
    assert on_disk["tv_mean"] == pytest.approx(float(t.tv[t.mask].double().mean()))
    assert on_disk["tail_head_ratio"] == pytest.approx(measured.vocab.tail_head_ratio)
    assert [x["name"] for x in on_disk["layers"]][:2] == ["embed", "layer.0"]
    assert all(set(x) == {"name", "rel_error", "share"} for x in on_disk["layers"])
    assert on_disk["first_divergent_layer"] == "embed"  # bf16 parameters round the embedding rows
    for name in ("trm_max", "trm_avg", "mis", "opsm", "veto", "dvp"):
        rec = on_disk["recommended"][name]
        assert "threshold" in rec and 0.0 <= rec["kept_fraction"] <= 1.0
    assert on_disk["envelope"]["corrected_violations"] == 0
    assert on_disk["checks"]["capture_max_abs_error"] == 0.0
    assert on_disk["meta"]["rollout"]["name"] == "w8kv8"


def test_pngs_are_written_and_embedded(report):
    _, summary, out = report
    page = (out / "report.html").read_text()
    embedded = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(embedded) == len(FIGURES)
    for name, data in zip(FIGURES, embedded):
        png = (out / f"{name}.png").read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 10_000
        assert base64.b64decode(data) == png  # the very file, embedded
    # self-contained: nothing fetched from elsewhere
    assert not re.search(r'(src|href)="(?!data:)', page)
    assert "w8kv8" in page and "Recommended thresholds" in page


def test_report_without_a_model(tmp_path):
    """Only sampled-token log-probs (a framework's dump): the report says what it cannot show, never invents it."""
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(8, 6, generator=g) * 8
    t = TokenData(completion_ids=torch.zeros(8, 6, dtype=torch.long), mask=torch.ones(8, 6, dtype=torch.bool),
                  trainer_logp=trainer, rollout_logp=trainer + 0.05 * torch.randn(8, 6, generator=g))
    summary = write_report(Measurements(tokens=t, meta={"source": "test"}), tmp_path)
    assert summary["kl_source"] == "k3 of the sampled token"
    assert summary["layers"] is None and summary["first_divergent_layer"] is None and summary["tv_mean"] is None
    assert summary["tail_head_source"] == "sampled tokens" and summary["envelope"] is None
    assert "dvp" not in summary["recommended"] and summary["recommended"]["trm_max"]["kept_fraction"] >= 0.7
    assert all((tmp_path / f"{name}.png").is_file() for name in FIGURES)


def test_markdown_table(report):
    _, summary, _ = report
    lines = markdown_table([summary, summary]).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| rollout | trainer | mean KL")
    assert lines[2].startswith("| w8kv8 | fp32 |") and "e^-" in lines[2]


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(_chromium() is None, reason="no chromium on this machine (.ci/run installs it)")
def test_report_renders_in_a_browser(report, tmp_path):
    """A headless Chromium screenshot of report.html: the page renders its tables and images (not a blank page)."""
    import matplotlib.image as mpimg

    _, _, out = report
    shot = tmp_path / "shot.png"
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                        f"--screenshot={shot}", "--window-size=1280,4000", (out / "report.html").as_uri()],
                       check=True, capture_output=True, timeout=120)
    img = mpimg.imread(shot)
    assert img.shape[0] == 4000 and img.shape[1] == 1280
    gray = img[..., :3].mean(-1)
    # dark text in the top band (headings, tables) and large non-white figures further down
    assert (gray[:600] < 0.3).mean() > 0.005
    bands = [(gray[y:y + 400] < 0.95).mean() for y in range(0, 4000, 400)]
    assert sum(b > 0.05 for b in bands) >= 5, bands
    # the figures are drawn, not broken-image icons: many distinct colours (the blue scatter, red points, …)
    colours = {tuple((img[y, x, :3] * 8).astype(int)) for y in range(0, 4000, 7) for x in range(0, 1280, 7)}
    assert len(colours) > 25  # text and tables alone give a handful (white, greys, black)


@pytest.mark.slow
def test_on_the_warm_started_embedded_model(tmp_path):
    """The embedded model after a (short) warm start, as `offpolicy inspect --model tiny` loads it: every part of the
    report is there and self-consistent."""
    from offpolicy.inspect.run import task_prompts
    from offpolicy.models import load_tiny_model

    model, tok = load_tiny_model(tmp_path / "cache", steps=20)
    prompts = task_prompts(tok, "arithmetic", 8)
    measured = inspect_engines(model, prompts, ROLLOUT_SPECS["fp32-head"], TRAINER_SPECS["bf16-autocast"],
                               SamplingConfig(max_new_tokens=16), tokenizer=tok, ignore_eos=True)
    summary = write_report(measured, tmp_path / "out")
    assert summary["positions"] == 8 * 16 and summary["kl_source"] == "exact"
    assert summary["first_divergent_layer"] == "embed" and len(summary["layers"]) == 4 + 3
    assert summary["envelope"]["corrected_violations"] == 0
    assert summary["recommended"]["dvp"]["kept_fraction"] > 0.9
    assert all(r["kept_fraction"] >= 0.7 for r in summary["recommended"].values())
