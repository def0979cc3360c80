"""TRL's own ``train()`` with two processes (torchrun; accelerate's multi-CPU DDP over gloo) against live vLLM:
one server (``vllm_mode="server"``) or an engine in each process (``"colocate"``); prints ``RESULT {json}``.

    PYTHONPATH=. python tests/vllm/scripts/trl_ranks.py URL          # from the repository root (offpolicy_testkit)
    PYTHONPATH=. python tests/vllm/scripts/trl_ranks.py colocate
    PYTHONPATH=. python tests/vllm/scripts/trl_ranks.py URL --bf16   # a bf16 policy against a bf16 server

Run without torchrun's environment, the script launches itself under ``python -m torch.distributed.run
--nproc_per_node 2`` once per scenario and collects what each rank wrote: a run whose syncs all pass, and one with a
sync that leaves the tied head behind. Server mode: the main process judges the one server, every rank pushes
through files (``FileSync``: TRL's NCCL transfer needs CUDA) and every rank must stop, naming the sync; the server is
handed the tiny checkpoint's weights before each run and at the end, so it can serve the tests around it. Colocate:
TRL builds a ``vllm.LLM`` in each process (``distributed_executor_backend="external_launcher"``, fp32 here so a head
one step behind stands out of the engine's noise), each process checks its own engine, and only rank 1's push is
broken — rank 0, whose own sync took, must stop too, naming rank 1. ``--bf16``: the policy's own parameters bf16
(``GRPOConfig(bf16=True)``) against a bf16 server: a run whose syncs all pass, and one whose push does nothing.
Run by tests/vllm/test_trl_live.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCENARIOS = {"server": ("ok", "head_left_behind"), "colocate": ("ok", "head_left_behind_on_rank1"),
             "server_bf16": ("bf16_ok", "bf16_noop_push")}
RANKS = 2
COLOCATE = "colocate"


def launch(url: str, kind: str) -> dict:
    from offpolicy.rollout.processes import free_port

    result: dict = {}
    for scenario in SCENARIOS[kind]:
        if url != COLOCATE:
            restore(url)  # the checkpoint's weights, whatever the run before left on the server
        out = tempfile.mkdtemp(prefix=f"trl-ranks-{scenario}-")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS),
                               "--master_port", str(free_port()), __file__, url, scenario, out],
                              capture_output=True, text=True, timeout=900)
        ranks = [json.loads(p.read_text()) if (p := Path(out, f"rank{r}.json")).exists() else None
                 for r in range(RANKS)]
        result[scenario] = {"returncode": proc.returncode, "seconds": time.perf_counter() - start, "ranks": ranks,
                            "output": (proc.stdout + proc.stderr)[-4000:]}
    if url != COLOCATE:
        restore(url)
    return result


def restore(url: str) -> None:
    """The server gets the tiny checkpoint's weights back, every tensor (the tied head under its own name)."""
    from offpolicy.models import load_model
    from offpolicy.rollout.protocols import vllm_reload_weights
    from offpolicy.rollout.weight_sync import ReloadFolder

    model, _ = load_model("tiny")
    folder = tempfile.mkdtemp(prefix="trl-ranks-restore-")
    ReloadFolder(folder).write(model.state_dict().items())
    vllm_reload_weights(url, folder, weights_path=folder, timeout=240.0)


def rank_main(url: str, scenario: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from offpolicy_testkit.trl_toy import (
        arithmetic_dataset,
        leave_head_behind,
        train_recording_sync_failure,
        varied_reward,
    )
    from trl import GRPOConfig

    from offpolicy.integrations.trl import OffPolicyGRPOTrainer
    from offpolicy.integrations.trl.vllm_sync import FileSync
    from offpolicy.models import load_model

    colocate = url == COLOCATE
    bf16 = scenario.startswith("bf16_")
    engine = (dict(vllm_mode="colocate", vllm_max_model_length=128) if colocate
              else dict(vllm_mode="server", vllm_server_base_url=url))
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-ranks-"), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=8, max_steps=4, report_to=[], use_cpu=True,
                      bf16=bf16, logging_steps=1, save_strategy="no", beta=0.0, seed=0, use_vllm=True,
                      vllm_importance_sampling_correction=False, learning_rate=1e-3, **engine)
    model, tok = load_model("tiny")
    if bf16:  # the policy's own parameters bf16, as a GPU user loads a bf16 checkpoint
        model = model.to(torch.bfloat16)
    trainer = OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args,
                                   train_dataset=arithmetic_dataset(), processing_class=tok,
                                   correction={"name": "tis", "upper": 2.0},
                                   vllm_kwargs={"dtype": "float32"} if colocate else None)
    sync = trainer.offpolicy_sync
    entry: dict = {"rank": dist.get_rank() if dist.is_initialized() else None,
                   "world": dist.get_world_size() if dist.is_initialized() else 1,
                   "distributed_type": str(trainer.accelerator.distributed_type),
                   "main": trainer.accelerator.is_main_process, "file_sync": isinstance(sync.push, FileSync)}
    if scenario == "head_left_behind" or (scenario == "head_left_behind_on_rank1" and entry["rank"] == 1):
        leave_head_behind(sync)
    if scenario == "bf16_noop_push":  # every process's push does nothing: the server keeps the checkpoint
        sync.push = lambda: None
    train_recording_sync_failure(trainer, entry)
    entry["steps"] = trainer.state.global_step
    entry["policy_dtype"] = str(next(trainer.model.parameters()).dtype)
    entry["log"] = {key: [row[key] for row in trainer.state.log_history if key in row]
                    for key in ("sync/ok", "sync/gap", "sync/baseline", "sync/step_rms", "sync/push_seconds", "sync/params_left",
                                "sync/params_checked", "sync/threshold", "loss")}
    Path(out, f"rank{entry['rank']}.json").write_text(json.dumps(entry))


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ:
        target = sys.argv[1]
        kind = COLOCATE if target == COLOCATE else "server_bf16" if "--bf16" in sys.argv[2:] else "server"
        print("RESULT " + json.dumps(launch(target, kind)))
    else:
        rank_main(*sys.argv[1:4])
