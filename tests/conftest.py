"""Fixtures for the whole suite: offline, one intra-op thread, and a random-init tiny model built once per module."""

from __future__ import annotations

import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in these tests may touch the network

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from offpolicy.models.tiny import build_tiny_model
from offpolicy.models.warm_start import torch_threads
from offpolicy.tasks import Example


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls: one thread is as fast as two, and avoids 10x slow-downs when the 2-core machine is shared.
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer): random init, fp32, eval."""
    return build_tiny_model(seed=0)


@pytest.fixture(scope="module")
def sharp(tiny):
    """The tiny model with logits scaled ×30 (final-norm weight), so next-token distributions have a head with
    p > 0.5 *and* a long tail with p < 1e-3 — the shape of a trained policy, without training."""
    import copy

    model = copy.deepcopy(tiny[0])
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)
    return model, tiny[1]


# -- shared helpers (fixtures that return functions: the suite imports test modules by path, not as a package) ---------


@pytest.fixture(scope="session")  # a pure function: safe to share, and usable inside hypothesis tests
def random_batch():
    """``make(seed, B, T, scale=0.1, mask_frac=0.8)`` → a :class:`~offpolicy.LogProbBatch` of random log-probs: π_old
    and μ drift from π_θ by ``scale`` (normal noise), about ``mask_frac`` of the tokens are valid, [B] advantages."""
    import torch

    from offpolicy.batch import LogProbBatch

    def make(seed: int, b: int, t: int, scale: float = 0.1, mask_frac: float = 0.8) -> LogProbBatch:
        g = torch.Generator().manual_seed(seed)
        logp = -3 * torch.rand(b, t, generator=g)
        old = logp + scale * torch.randn(b, t, generator=g)
        rollout = old + scale * torch.randn(b, t, generator=g)
        mask = torch.rand(b, t, generator=g) < mask_frac
        return LogProbBatch(logp=logp, old_logp=old, rollout_logp=rollout, mask=mask,
                            advantages=torch.randn(b, generator=g))

    return make


@pytest.fixture
def verl_policy_loss():
    """``loss(loss_mode, old_logp, logp, advantages [B, T], mask, loss_agg_mode="token-mean", **actor_config)`` →
    verl 0.9's own registered policy loss (``core_algos.get_policy_loss_fn``), with an ``ActorConfig`` built from
    ``actor_config``. Skips the test when verl is not installed."""
    pytest.importorskip("verl")
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config.actor import ActorConfig

    def loss(loss_mode, old_logp, logp, advantages, mask, loss_agg_mode="token-mean", **actor_config):
        config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, **actor_config)
        return get_policy_loss_fn(loss_mode)(old_logp, logp, advantages, mask.float(), loss_agg_mode, config)

    return loss


@dataclass
class VaryingTask:
    """Reward = fraction of digit characters in the completion (varies across random samples, so A ≠ 0)."""

    name: str = "varying"
    fail: str | None = None  # "raise" | "nan": a broken reward for the error-path tests

    def examples(self, n: int, seed: int) -> list[Example]:
        return [Example(prompt=f"{seed % 97 + i}+1=", answer=str(seed % 97 + i + 1)) for i in range(n)]

    def reward(self, completions: list[str], *, answer: list[str], **kwargs: Any) -> list[float]:
        if self.fail == "raise":
            raise RuntimeError("boom")
        out = [sum(ch.isdigit() for ch in c) / max(len(c), 1) + 0.1 * len(c) for c in completions]
        if self.fail == "nan":
            out[1] = float("nan")
        return out


@pytest.fixture
def varying_task():
    """The class of a task whose reward varies across random samples (so advantages are not all 0)."""
    return VaryingTask


# -- CI: no silent skips of the integrations ------------------------------------------------------------------------
# A test of the TRL, verl, vLLM, OpenRLHF or DeepSpeed integration skips when its package is missing or at a version the adapter
# does not support (importorskip, or a skip naming the version). That is right for a user's `python -m pytest`, and
# wrong for CI's second phase, which installs those packages at the tested versions (TRL 1.16, verl 0.9.1, vLLM's
# CPU build, OpenRLHF 0.11.2, DeepSpeed 0.19.8): there a skip means an adapter went untested. So .ci/run sets
# OFFPOLICY_REQUIRE_INTEGRATIONS=1 for that phase, and such a skip fails instead (a module or folder skipped at import
# becomes one failing test). A skip for missing hardware (a CUDA GPU) stays a skip. OFFPOLICY_SKIPPED_LOG=<file>
# appends "<node id>\t<reason>" for every integration skip, so that CI reruns those tests once the packages are in.

_INTEGRATION_SKIP = re.compile(r"\b(trl|verl|vllm|openrlhf|deepspeed)\b|could not import '(datasets|hydra)\b", re.IGNORECASE)
_HARDWARE_SKIP = re.compile(r"\b(GPU|CUDA)\b")


def integration_skip(reason: str) -> bool:
    """Whether a skip's reason is an integration's package missing or at another version (not missing hardware)."""
    return bool(_INTEGRATION_SKIP.search(reason)) and not _HARDWARE_SKIP.search(reason)


def _require_integrations() -> bool:
    return os.environ.get("OFFPOLICY_REQUIRE_INTEGRATIONS", "") == "1"


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _required(reason: str) -> str:
    return (f"{reason}\nOFFPOLICY_REQUIRE_INTEGRATIONS=1: CI installs the integrations at their tested versions, so "
            "this skip is a failure (install the package, or unset the variable to let it skip)")


def _log_skip(nodeid: str, reason: str) -> None:
    path = os.environ.get("OFFPOLICY_SKIPPED_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{nodeid}\t{' '.join(reason.split())}\n")


class _SkippedIntegration(pytest.Item):
    """Stands in for a module or folder whose import skipped for an integration: it fails with the skip's reason."""

    def __init__(self, *, reason: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reason = reason

    def runtest(self) -> None:
        pytest.fail(_required(self.reason), pytrace=False)

    def reportinfo(self):
        return self.path, None, f"{self.parent.nodeid} (skipped at import)"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if report.skipped:
        reason = _skip_reason(report)
        if integration_skip(reason):
            _log_skip(report.nodeid, reason)
            if _require_integrations():
                item = _SkippedIntegration.from_parent(collector, name="skipped-at-import", reason=reason)
                return pytest.CollectReport(report.nodeid, "passed", None, [item], sections=report.sections)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if integration_skip(reason):
            _log_skip(report.nodeid, reason)
            if _require_integrations():
                report.outcome = "failed"
                report.longrepr = _required(reason)
    return report
