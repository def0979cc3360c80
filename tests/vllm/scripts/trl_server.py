"""TRL's own ``train()`` against a live vLLM server (``vllm_mode="server"``) on a CPU trainer; prints ``RESULT {json}``.

    PYTHONPATH=. python tests/vllm/scripts/trl_server.py URL     # from the repository root (offpolicy_testkit)

The server (``python -m vllm.entrypoints.openai.api_server`` with ``VLLM_SERVER_DEV_MODE=1``, started by the test on
the embedded tiny model, fp32) generates; TRL's own weight transfer cannot run here (its NCCL group needs a CUDA
device), so ``OffPolicyGRPOTrainer`` sends the weights through files (``FileSync``) and checks every sync. Scenarios:
TRL's plain ``GRPOTrainer`` (what fails, and how), a run whose syncs all pass, and one whose sync leaves the tied
head behind. Run by tests/vllm/test_trl_live.py.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

if __name__ == "__main__":
    from offpolicy_testkit.trl_toy import (
        arithmetic_dataset,
        leave_head_behind,
        train_recording_sync_failure,
        varied_reward,
    )
    from trl import GRPOConfig, GRPOTrainer

    from offpolicy.integrations.trl import OffPolicyGRPOTrainer
    from offpolicy.integrations.trl.vllm_sync import FileSync
    from offpolicy.models import load_model

    url = sys.argv[1]

    def config(**kw) -> GRPOConfig:
        base = dict(output_dir=tempfile.mkdtemp(prefix="trl-server-"), per_device_train_batch_size=8,
                    num_generations=4, max_completion_length=8, max_steps=4, report_to=[], use_cpu=True, bf16=False,
                    logging_steps=1, save_strategy="no", beta=0.0, seed=0, use_vllm=True, vllm_mode="server",
                    vllm_server_base_url=url, vllm_importance_sampling_correction=False, learning_rate=1e-3)
        return GRPOConfig(**{**base, **kw})

    def numbers(trainer) -> dict:
        out: dict = {}
        for row in trainer.state.log_history:
            for key, value in row.items():
                if key.startswith(("sync/", "offpolicy/tis", "sampling/importance")) and isinstance(value, float):
                    out.setdefault(key, []).append(value)
        return out

    result: dict = {}
    # TRL's own server mode on a CPU trainer
    model, tok = load_model("tiny")
    try:
        GRPOTrainer(model=model, reward_funcs=varied_reward, args=config(), train_dataset=arithmetic_dataset(),
                    processing_class=tok)
        result["trl_plain"] = None
    except Exception as err:  # noqa: BLE001 - recorded: what TRL raises is the finding
        result["trl_plain"] = f"{type(err).__name__}: {err}"

    for name in ("ok", "head_left_behind"):
        model, tok = load_model("tiny")
        start = time.perf_counter()
        trainer = OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=config(),
                                       train_dataset=arithmetic_dataset(), processing_class=tok,
                                       correction={"name": "tis", "upper": 2.0})
        sync = trainer.offpolicy_sync
        entry: dict = {"file_sync": isinstance(sync.push, FileSync)}
        if name == "head_left_behind":
            leave_head_behind(sync)
        train_recording_sync_failure(trainer, entry)
        entry["log"] = numbers(trainer)
        entry["seconds"] = time.perf_counter() - start
        result[name] = entry
        # hand the server the checkpoint's weights back (every tensor, the tied head included) for the next run
        fresh, _ = load_model("tiny")
        trainer.model.load_state_dict(fresh.state_dict())
        FileSync(trainer.vllm_generation)()
    print("RESULT " + json.dumps(result))
