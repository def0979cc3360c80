"""TRL's ``train()`` with two processes in server mode, the vLLM server SIGKILLed (or SIGSTOPped: it takes the
connection and never answers) between two steps: both ranks stop within TRL's ``vllm_server_timeout``, each naming
the server and the sync — the main rank's weight push is refused (or times out) and the other rank, which pushed
nothing, raises the same error through :func:`offpolicy.integrations.trl.ranks.every_rank_raises` instead of
waiting in TRL's next collective (tests/vllm/scripts/trl_server_kill.py; ≈ 90 s each with the server's start on two
cores)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offpolicy.rollout.processes import free_port
from offpolicy.rollout.vllm_server import VLLMServer, vllm_cpu_env

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "scripts" / "trl_server_kill.py"
REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 30.0  # TRL's vllm_server_timeout for the run: what bounds the plug-in's engine calls
SLACK = 30.0  # the ranks' own exit on two shared cores


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_two_trl_ranks_stop_within_the_timeout_when_the_server_dies(tmp_path, vllm_cache, how):
    from offpolicy.models import model_path

    served = tmp_path / "served"
    shutil.copytree(model_path("tiny"), served)
    out = tmp_path / "run"
    out.mkdir()
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, **vllm_cpu_env(vllm_cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    with VLLMServer(served, dtype="float32", cache_dir=vllm_cache, extra_args=["--max-num-seqs", "16"]) as server:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                 "--master_port", str(free_port()), str(SCRIPT), server.url, str(out), str(TIMEOUT)],
                                env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 600
            while not (out / "step1").exists():
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
                time.sleep(0.1)
            if how == "SIGKILL":
                server.kill()
            else:  # the whole group stopped: the kernel still accepts connections, nothing answers
                os.killpg(server.process.pid, signal.SIGSTOP)
            killed = time.monotonic()
            (out / "killed").write_text("")
            output = proc.communicate(timeout=TIMEOUT + SLACK + 60)[0]
            stopped = time.monotonic() - killed
        finally:
            if proc.poll() is None:
                proc.kill()
            server.kill()  # a stopped group takes SIGKILL
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    print(f"{how}-to-stop: {stopped:.1f} s (torchrun's exit); ranks: {ranks}")
    assert proc.returncode != 0 and stopped < TIMEOUT + SLACK, output[-4000:]
    main, other = ranks
    # the main rank's push was refused, or not answered within the timeout: one line naming the server, the sync
    # and the timeout's setting
    failure = (f"cannot reach {server.url}/pause" if how == "SIGKILL" else
               f"{server.url}/pause did not answer within {TIMEOUT:g} s: is it running?")
    assert main["error"].startswith(f"ServerError: vllm weight reload /pause: {failure}"), main
    assert how == "SIGKILL" or stopped >= TIMEOUT
    assert "at sync 2" in main["error"] and "GRPOConfig.vllm_server_timeout" in main["error"], main
    assert "\n" not in main["error"]
    # the other rank raised the same, naming rank 0, at the same step
    assert other["error"] == main["error"].replace("ServerError: ", "ServerError: rank 0: ", 1), other
    assert main["step"] == other["step"] == 1
