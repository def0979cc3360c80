"""scripts/docs_figures.py draws every figure the docs link, and its weights are the library's (hand values)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
import torch  # noqa: E402

import offpolicy as op  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "scripts" / "docs_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_weights_helper_matches_hand_values():
    fig = _script()
    rho = torch.tensor([0.25, 1.0, 3.0, 8.0])
    assert torch.allclose(fig.weights(op.tis(upper=2.0), rho, 1), torch.tensor([0.25, 1.0, 2.0, 2.0]))
    assert torch.allclose(fig.weights(op.icepop(), rho, 1), torch.tensor([0.0, 1.0, 3.0, 0.0]))
    # a 4-token sequence of ratio 1.25 each: the product ratio 1.25⁴ = 2.44 is capped at 2
    assert torch.allclose(fig.weights(op.tis(upper=2.0, level="sequence"), torch.tensor([1.25]), 4),
                          torch.tensor([2.0]))


@pytest.mark.parametrize("name", ["draw_trl_dataflow", "draw_choosing_flowchart", "draw_three_policies"])
def test_each_new_figure_draws(tmp_path, name):
    path = tmp_path / "f.png"
    getattr(_script(), name)(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_every_figure_the_docs_link_exists():
    for page, image in (("choosing.md", "img/choosing_flowchart.png"), ("words.md", "img/three_policies.png"),
                        ("frameworks/trl.md", "trl_dataflow.png"), ("frameworks/verl.md", "verl_dataflow.png")):
        text = (ROOT / "docs" / page).read_text(encoding="utf-8")
        assert f"]({image})" in text, f"docs/{page} does not show {image}"
        assert (ROOT / "docs" / page).parent.joinpath(image).is_file()
