"""One rank of TRL's own ``train()`` (torchrun, two processes, accelerate's multi-CPU DDP over gloo) in server mode
against a live vLLM server that the test kills between two steps; run by tests/vllm/test_trl_server_kill_live.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/vllm/scripts/trl_server_kill.py URL OUT TIMEOUT

After its first step the main rank writes ``OUT/step1`` and waits for ``OUT/killed`` (the test kills the server
then), so the next server call is the plug-in's weight push (``FileSync``). Each rank writes ``OUT/rank{r}.json``:
the exception ``train()`` raised (type and message) and the step it stopped at. ``TIMEOUT`` is TRL's
``vllm_server_timeout``, which bounds the plug-in's engine calls.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path


def rank_main(url: str, out: str, timeout: str) -> None:
    import torch.distributed as dist
    from offpolicy_testkit.trl_toy import arithmetic_dataset, varied_reward
    from transformers import TrainerCallback
    from trl import GRPOConfig

    from offpolicy.integrations.trl import OffPolicyGRPOTrainer
    from offpolicy.models import load_model

    class PauseAfterFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1 and state.is_world_process_zero:
                Path(out, "step1").write_text("")
                while not Path(out, "killed").exists():
                    time.sleep(0.05)

    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-kill-"), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=8, max_steps=6, report_to=[], use_cpu=True,
                      bf16=False, logging_steps=1, save_strategy="no", beta=0.0, seed=0, use_vllm=True,
                      vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=float(timeout),
                      vllm_importance_sampling_correction=False, learning_rate=1e-3)
    model, tok = load_model("tiny")
    trainer = OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args,
                                   train_dataset=arithmetic_dataset(), processing_class=tok,
                                   correction={"name": "tis", "upper": 2.0}, callbacks=[PauseAfterFirstStep()])
    rank = dist.get_rank()
    entry: dict = {"rank": rank, "error": None}
    try:
        trainer.train()
    except Exception as err:  # noqa: BLE001 - what each rank raised is the test's subject
        entry.update(error=f"{type(err).__name__}: {err}", step=trainer.state.global_step, at=time.time())
    Path(out, f"rank{rank}.json").write_text(json.dumps(entry))
    sys.stdout.flush()
    # leave at once, without tearing down the group the other rank may still hold (gloo's threads at exit)
    os._exit(1 if entry["error"] else 0)


if __name__ == "__main__":
    rank_main(*sys.argv[1:4])
