"""Record OpenRLHF 0.11.2's own importance-sampling gate (``openrlhf.models.loss.PolicyLoss``, ``is_correction_*``)
on fixed batches, for ``tests/corrections/test_gated_openrlhf.py``.

Run with a Python that has ``openrlhf==0.11.2`` (installed ``--no-deps``: its requirements pull a CUDA torch,
deepspeed, vLLM …; check that torch is untouched) and torch, e.g.

    pip install --no-deps openrlhf==0.11.2
    python tests/corrections/data/openrlhf_gate.py > tests/corrections/data/openrlhf_gate.json

Only ``openrlhf/models/loss.py`` and ``openrlhf/models/utils.py`` are loaded, as modules of a bare ``openrlhf.models``
package: the package's ``__init__`` imports the actor (transformers, deepspeed …), and ``utils.py`` imports deepspeed
at the top for functions the loss never calls, so an empty placeholder module stands in for it (in this process
only, and only when deepspeed is not installed).

The record keeps its provenance in a form a test can check: the sha256 of the two files this process loaded
(``files``) and the versions of OpenRLHF, torch and Python (``versions``). The live test reruns this script and
requires the same hashes, and the wheel's own ``RECORD`` hashes for the installed files.

Per case the script records the inputs, the per-token coefficient the gate multiplies into the PPO loss (read from the
gradient: at log π_θ = log π_old and A = −1 every token's PPO term is 1 with ∂/∂log π_θ = 1, so ∂loss/∂log π_θ,t =
coef_t / N, N the valid tokens), ``is_filter_ratio``, ``vllm_kl`` and the loss on random π_θ and advantages.

``python openrlhf_gate.py --cases`` instead runs the batches and settings given as JSON on stdin (``run_given_cases``),
for ``tests/corrections/test_gated_differences.py``.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import torch


def load_policy_loss():
    import openrlhf  # noqa: F401  (only to locate the installed package; its __init__ is light)

    root = Path(sys.modules["openrlhf"].__file__).parent / "models"
    if importlib.util.find_spec("deepspeed") is None:  # utils.py imports it for helpers the loss never calls
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    package = types.ModuleType("openrlhf.models")
    package.__path__ = [str(root)]
    sys.modules["openrlhf.models"] = package
    # stdout carries the record: an installed deepspeed logs its accelerator choice there on import
    with contextlib.redirect_stdout(sys.stderr):
        for name in LOADED:
            spec = importlib.util.spec_from_file_location(f"openrlhf.models.{name}", root / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
    return sys.modules["openrlhf.models.loss"].PolicyLoss


LOADED = ("utils", "loss")  # the modules of openrlhf.models that load_policy_loss executes


def loaded_files() -> dict[str, str]:
    """sha256 (hex) of each OpenRLHF file this process executed, keyed by its path inside the package
    (``openrlhf/models/loss.py``): read from the loaded modules' own ``__file__``, after :func:`load_policy_loss`."""
    out = {}
    for name in LOADED:
        path = Path(sys.modules[f"openrlhf.models.{name}"].__file__)
        out[f"openrlhf/models/{path.name}"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def batches() -> dict[str, dict[str, torch.Tensor]]:
    """Fixed batches: ``moderate`` (μ and π_old apart by N(0, 0.3²) per token, padding at the ends of rows) and
    ``nearby`` (|log π_old − log μ| ≤ 1e-6, p across (1e-3, 1 − 1e-6)): OpenRLHF's float32 binary KL goes negative."""
    g = torch.Generator().manual_seed(1339)
    b, t = 6, 10
    old = -4 * torch.rand(b, t, generator=g) ** 2  # p from e^-4 to 1
    old[0, :3] = torch.tensor([-1e-7, -2e-6, -1e-3])  # near p = 1 (the clamp at 1 − 1e-6 acts on the first two)
    old[1, :2] = torch.tensor([-15.0, -14.0])  # below the clamp at 1e-6 (e^-14 = 8.3e-7)
    rollout = old + 0.3 * torch.randn(b, t, generator=g)
    rollout = rollout.clamp(max=0.0)
    lengths = torch.tensor([10, 7, 10, 4, 9, 1])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    logp = old + 0.1 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    out = {"moderate": {"old_logp": old, "rollout_logp": rollout, "logp": logp, "advantages": adv, "mask": mask}}
    # log p by the C library in float64, then rounded: the same float32 inputs on every CPU (torch.log's vectorised
    # float32 log may differ in the last bit between CPUs, and these inputs are about last bits)
    p = [1e-3, 0.05, 0.3, 0.5, 0.7, 0.9, 0.99, 1 - 1e-4, 1 - 1e-5, 1 - 1e-6]
    a = torch.tensor([math.log(x) for x in p], dtype=torch.float32)
    deltas = torch.tensor([1e-6, -1e-6, 5e-7, -5e-7, 1e-7, -1e-7])
    old_n = (a[None, :] - deltas[:, None]).clamp(max=0.0)
    roll_n = a[None, :].expand_as(old_n).contiguous()
    out["nearby"] = {"old_logp": old_n, "rollout_logp": roll_n, "logp": old_n.clone(),
                     "advantages": torch.ones_like(old_n), "mask": torch.ones_like(old_n)}
    return out


CASES = [  # (batch, level, mode, gating, threshold)
    ("moderate", "token", "mask", "ratio", [0.5, 5.0]),
    ("moderate", "token", "mask", "ratio", [0.8, 1.25]),
    ("moderate", "seq", "mask", "ratio", [0.9, 1.15]),
    ("moderate", "token", "clip", "ratio", [0.8, 1.25]),
    ("moderate", "token", "mask", "binary_kl", [0.0, 0.01]),
    ("moderate", "seq", "mask", "binary_kl", [0.0, 0.1]),
    ("moderate", "token", "mask", "tv", [0.0, 0.05]),
    ("moderate", "seq", "mask", "tv", [0.0, 0.1]),
    ("nearby", "token", "mask", "binary_kl", [0.0, 5e-3]),
    ("nearby", "seq", "mask", "binary_kl", [0.0, 5e-3]),
]


def run_case(policy_loss, x: dict[str, torch.Tensor], level: str, mode: str, gating: str,
             threshold: list[float]) -> dict:
    """One setting of OpenRLHF's gate on one batch ``x`` (``old_logp``, ``rollout_logp``, ``logp``, ``advantages``,
    ``mask``, each [B, T]): the per-token coefficient (from the gradient at log π_θ = log π_old, A = −1),
    ``is_filter_ratio``, ``vllm_kl`` and the loss at ``logp`` / ``advantages`` — as floats, inf or NaN included."""
    fn = policy_loss(clip_eps_low=0.2, clip_eps_high=0.2, is_correction_level=level, is_correction_mode=mode,
                     is_correction_gating=gating, is_correction_threshold=list(threshold))
    logp = x["old_logp"].clone().requires_grad_(True)
    loss, _, _, vllm_kl, filter_ratio = fn(logp, x["old_logp"], -torch.ones_like(logp), action_mask=x["mask"],
                                           rollout_log_probs=x["rollout_logp"])
    loss.backward()
    coef = logp.grad * x["mask"].sum()
    random_loss = fn(x["logp"], x["old_logp"], x["advantages"], action_mask=x["mask"],
                     rollout_log_probs=x["rollout_logp"])[0]
    return {"level": level, "mode": mode, "gating": gating, "threshold": list(threshold), "coef": coef.tolist(),
            "is_filter_ratio": float(filter_ratio), "vllm_kl": float(vllm_kl), "loss": float(random_loss)}


def versions() -> dict[str, str]:
    import importlib.metadata

    return {"openrlhf": importlib.metadata.version("openrlhf"), "torch": torch.__version__,
            "python": ".".join(map(str, sys.version_info[:3]))}


def run_given_cases() -> None:
    """``--cases``: read ``{"inputs": {name: batch}, "cases": [[name, level, mode, gating, threshold], ...]}`` as JSON
    on stdin (non-finite floats as JSON's ``Infinity`` / ``NaN``), write ``{"versions", "files", "cases"}`` (each case
    :func:`run_case`'s record plus its ``batch``) — for tests that build their own batches."""
    request = json.load(sys.stdin)
    data = {name: {k: torch.tensor(v, dtype=torch.float32) for k, v in x.items()}
            for name, x in request["inputs"].items()}
    policy_loss = load_policy_loss()
    records = [{"batch": name, **run_case(policy_loss, data[name], level, mode, gating, threshold)}
               for name, level, mode, gating, threshold in request["cases"]]
    json.dump({"versions": versions(), "files": loaded_files(), "cases": records}, sys.stdout)
    sys.stdout.write("\n")


def main() -> None:
    policy_loss = load_policy_loss()
    data = batches()
    records = [{"batch": batch_name, **run_case(policy_loss, data[batch_name], level, mode, gating, threshold)}
               for batch_name, level, mode, gating, threshold in CASES]
    inputs = {name: {k: v.tolist() for k, v in x.items()} for name, x in data.items()}
    json.dump({"versions": versions(), "files": loaded_files(), "inputs": inputs, "cases": records}, sys.stdout,
              indent=1, allow_nan=False)
    sys.stdout.write("\n")
    assert not any(math.isnan(r["loss"]) for r in records)

if __name__ == "__main__":
    run_given_cases() if sys.argv[1:] == ["--cases"] else main()
