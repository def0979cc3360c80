"""The public API: every name in ``__all__`` exists, the README's five lines run, and ``import offpolicy`` needs torch only."""

import subprocess
import sys

import torch

import offpolicy as op


def test_all_names_exist_and_are_unique():
    assert len(op.__all__) == len(set(op.__all__))
    missing = [name for name in op.__all__ if not hasattr(op, name)]
    assert missing == []


def test_import_needs_torch_only():
    code = "import sys, offpolicy; print(sorted(m for m in ('transformers', 'pydantic', 'typer', 'trl') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_readme_five_lines():
    # The README example on a batch where the answer is known: on-policy (μ = π_old = π_θ), A = (1, -1).
    # Every ratio is 1, nothing is masked, so the loss is -mean_t(r·A) = -(1·3 + (-1)·3)/6 = 0 and ∂L/∂logp = -A/6.
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    old_logp = logp.detach().clone()
    rollout_logp = logp.detach().clone()
    mask = torch.ones(2, 3)
    adv = torch.tensor([1.0, -1.0])

    batch = op.LogProbBatch(logp=logp, old_logp=old_logp, rollout_logp=rollout_logp, mask=mask, advantages=adv)
    correction = op.chain(op.icepop(), op.opsm(delta=1e-4))
    loss, metrics = op.policy_loss(batch, correction=correction, clip_high=0.28)
    loss.backward()

    assert loss.item() == 0.0
    assert torch.allclose(logp.grad, -adv[:, None].expand(2, 3) / 6)
    assert metrics["chain/kept_frac"].item() == 1.0  # on policy: nothing masked or capped
    assert all(isinstance(v, torch.Tensor) for v in metrics.values())


def test_the_docs_plug_in_example_registers_and_runs_by_name():
    import pathlib
    import re

    from offpolicy.registry import CORRECTIONS, OBJECTIVES

    page = (pathlib.Path(__file__).parents[1] / "docs" / "getting-started.md").read_text()
    section = page.split("## Methods by name", 1)[1].split("\n## ", 1)[0]
    example = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    try:
        exec(example, {"op": op, "torch": torch})
        logp = torch.full((2, 3), -1.0, requires_grad=True)
        batch = op.LogProbBatch(logp=logp, old_logp=logp.detach(), rollout_logp=logp.detach(), mask=torch.ones(2, 3),
                                advantages=torch.tensor([1.0, -1.0]))
        correction = op.build_correction([{"name": "half_weight", "factor": 0.25}, {"name": "icepop"}])
        loss, metrics = op.policy_loss(batch, correction=correction, objective={"name": "scaled_reinforce", "scale": 2.0})
        loss.backward()
        # L = mean_t(−2 · 0.25 · A · logp) with logp = −1: (0.5·3 − 0.5·3)/6 = 0; ∂L/∂logp = −0.5·A/6
        assert loss.item() == 0.0 and metrics["half_weight/factor"].item() == 0.25
        assert torch.allclose(logp.grad, -0.5 * torch.tensor([1.0, -1.0])[:, None].expand(2, 3) / 6)
    finally:
        for registry, name in ((CORRECTIONS, "half_weight"), (OBJECTIVES, "scaled_reinforce")):
            if name in registry:
                registry.unregister(name)
