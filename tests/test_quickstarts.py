"""The two quickstarts run as their pages say (docs/quickstart-trl.md, docs/quickstart-verl.md): the scripts under
examples/ on CPU, their logged metrics in the glossary, and the verl page's launch command is the script's."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from offpolicy.glossary import lookup

ROOT = Path(__file__).resolve().parents[1]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"offpolicy_example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 4 TRL steps of the lab model: ~25 s on 2 quiet cores, up to ~60 s on shared ones
def test_the_trl_quickstart_corrects_a_real_mismatch(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    rows = _example("quickstart_trl").run(steps=4, sync_every=4, upper=2.0, out=str(tmp_path))
    assert len(rows) == 4
    k3 = [r["sampling/k3_kl"] for r in rows]
    # step 1: a synced bf16 engine, numerics only; step 4: three steps of lag — a mismatch TIS has to act on
    assert 0 < k3[0] < 1e-2 and k3[3] > 20 * k3[0] and k3[1] < k3[2] < k3[3]
    for r in rows:  # TIS's own bookkeeping: w = min(ρ, 2), nothing masked, capped iff some ratio passed the cap
        assert r["offpolicy/tis/masked_frac"] == 0.0
        assert r["offpolicy/tis/kept_frac"] + r["offpolicy/tis/capped_frac"] == pytest.approx(1.0)
        assert r["offpolicy/tis/weight_mean"] <= r["offpolicy/tis/raw_ratio_mean"] + 1e-6
        assert (r["offpolicy/tis/capped_frac"] > 0) == (r["offpolicy/tis/raw_ratio_max"] > 2.0)
    ours = [k for k in rows[0] if k.startswith(("offpolicy/", "sampling/"))]
    assert len(ours) > 30 and [k for k in ours if lookup(k) is None] == []


@pytest.mark.slow  # one TRL step of the mixture-of-experts lab model, two `--help`s: ~30 s on shared cores
def test_the_trl_examples_take_the_mixture_of_experts_lab_model(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    import subprocess
    import sys

    rows = _example("quickstart_trl").run(steps=1, sync_every=1, upper=2.0, out=str(tmp_path), model_name="lab-moe")
    assert len(rows) == 1
    row = rows[0]
    # the bf16 engine on lab-moe against the fp32 trainer: a real mismatch (bf16 rounding, experts flipped at
    # near-ties), and TIS's bookkeeping on it
    assert 0 < row["sampling/k3_kl"] < 1e-2 and row["offpolicy/tis/masked_frac"] == 0.0
    assert row["offpolicy/tis/weight_mean"] <= row["offpolicy/tis/raw_ratio_mean"] + 1e-6
    for name in ("quickstart_trl", "trl_dvp_alp"):  # both take it by name where they take lab
        out = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py"), "--help"], capture_output=True,
                             text=True, timeout=300, check=True).stdout
        assert "{tiny,lab,lab-moe}" in out, out


def test_the_verl_quickstart_runs_as_far_as_verl_starts_on_cpu(monkeypatch):
    pytest.importorskip("verl")
    pytest.importorskip("hydra")
    example = _example("quickstart_verl")
    for key, value in example.job_environment().items():  # run() sets them as Ray would; undone after the test
        monkeypatch.setenv(key, value)
    out = example.run()
    assert "offpolicy" in out["registered"]["policy_loss"].split(", ")
    assert out["registered"]["agent_loop"] == "offpolicy_agent"
    cfg = out["config"]
    assert cfg.trainer.v1.trainer_mode == "offpolicy" and cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    assert cfg.actor_rollout_ref.model.external_lib == "offpolicy.integrations.verl.plugin"
    assert out["settings"].correction == {"name": "tis", "upper": 2.0}
    step, mask = out["step"], out["step"]["response_mask"]
    ratio = (step["old_log_probs"] - step["rollout_log_probs"]).exp()
    torch.testing.assert_close(out["updates"]["rollout_is_weights"], ratio.clamp(max=2.0) * mask)
    assert bool((ratio[mask.bool()] > 2.0).any())  # the made-up step does exercise the cap
    assert [k for k in out["metrics"] if lookup(k) is None] == []
    assert "GPUs" in out["stop"]
    if importlib.util.find_spec("transfer_queue") is not None:  # the verl extra installs it: the trainer registers
        assert out["registered"]["trainer"] == "offpolicy" and out["trainer_base"] == "PPOTrainerSync"
    else:
        assert "transfer_queue" in out["registered"]["trainer"] and "transferqueue" in out["stop"]
    # verl's own token IS next to the plug-in's correction: the one-line refusal, naming both keys
    assert out["refused"].startswith("algorithm.rollout_correction.rollout_is='token' and OFFPOLICY_VERL's "
                                     "correction are both set") and "\n" not in out["refused"]


def test_the_verl_pages_launch_command_is_the_scripts():
    page = (ROOT / "docs" / "quickstart-verl.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(python -m verl\.trainer\.main_ppo.*?)```", page, re.S)
    assert blocks == [_example("quickstart_verl").launch_command() + "\n"]


def test_the_trl_page_runs_the_script_it_shows():
    page = (ROOT / "docs" / "quickstart-trl.md").read_text(encoding="utf-8")
    assert "python examples/quickstart_trl.py" in page and "--logprobs-mode processed_logprobs" in page
    header = page.split("```text\n", 1)[1].split("\n", 2)[:2]  # the printed table's title and columns
    script = (ROOT / "examples" / "quickstart_trl.py").read_text(encoding="utf-8")
    assert "TIS (cap" in header[0] and all(name in header[1] for name in ("k3 KL", "TIS capped", "reward"))
    assert all(f'"{name}"' in script for name in ("k3 KL", "ratio min", "ratio max", "TIS capped", "weight mean"))


def test_the_readmes_verl_keys_are_the_quickstarts():
    # the README's verl snippet is the quickstart's five overrides, in the script's order and shell quoting
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.findall(r"```bash\n(python -m verl\.trainer\.main_ppo \.\.\. \\\n.*?)```", readme, re.S)
    example = _example("quickstart_verl")
    assert len(block) == 1 and len(example.OFFPOLICY_OVERRIDES) == 5
    lines = [line.strip().rstrip("\\").strip() for line in block[0].splitlines()[1:]]
    assert lines == [example._shell(o) for o in example.OFFPOLICY_OVERRIDES]
