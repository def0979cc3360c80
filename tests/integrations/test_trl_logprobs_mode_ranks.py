"""TRL server mode with two processes (gloo): a vLLM server without ``--logprobs-mode processed_logprobs`` is refused
at start on every rank — the main rank (TRL's client) asks the server, the other ranks get its verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from offpolicy.rollout.processes import free_port

HERE = Path(__file__).resolve()


def run_rank(rank: int, world: int, port: int, out: str, mode: str) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist

    from offpolicy.integrations.trl.parts.vllm import VLLMWiring

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        part = VLLMWiring.__new__(VLLMWiring)
        part.accelerator = SimpleNamespace(is_main_process=rank == 0)
        info = {"model_config": {"logprobs_mode": mode}}
        # TRL builds the client on the main process only
        client = SimpleNamespace(get_server_info=lambda: info) if rank == 0 else None
        part.vllm_generation = SimpleNamespace(vllm_client=client)
        error = None
        try:
            part._check_logprobs_mode(SimpleNamespace(use_vllm=True, vllm_mode="server"))
        except ValueError as err:
            error = str(err)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"error": error}))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _run(tmp_path, mode):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(HERE), str(r), "2", str(port), str(tmp_path), mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    return [json.loads((tmp_path / f"rank{r}.json").read_text())["error"] for r in range(2)]


def test_raw_logprobs_server_is_refused_on_every_rank(tmp_path):
    main, other = _run(tmp_path, "raw_logprobs")
    assert main.startswith("logprobs_mode: the vLLM server runs with --logprobs-mode raw_logprobs")
    assert other == f"rank 0 (the vLLM client's process): {main}"
    assert _run(tmp_path, "processed_logprobs") == [None, None]


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    sys.stdout.flush()
    os._exit(0)  # as tests/integrations/test_trl_sync_ranks.py: leave without gloo's teardown
