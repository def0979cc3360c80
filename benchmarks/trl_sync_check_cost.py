"""What the sync check costs inside TRL with vLLM colocated (CPU build, the embedded tiny model, bf16 engine): the push
(TRL's weights into vLLM through ``reload_weights``) against the check (the probe scored by vLLM's prompt log-probs and
by the trainer), interleaved in one process, and a whole TRL step for scale.

    PYTHONPATH=. python benchmarks/trl_sync_check_cost.py --repeats 10     # from the repository root (offpolicy_testkit)

Medians over the repeats (push, check, push, check, …, so load from other processes hits both alike); on a shared
machine compare the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=4)
    cli = parser.parse_args()
    from offpolicy.rollout.vllm_server import vllm_cpu_env

    for key, value in vllm_cpu_env().items():
        os.environ.setdefault(key, value)
    import torch
    from offpolicy_testkit.trl_toy import arithmetic_dataset, varied_reward
    from trl import GRPOConfig

    from offpolicy.integrations.trl import OffPolicyGRPOTrainer
    from offpolicy.models import load_model

    model, tok = load_model("tiny")
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, max_steps=cli.steps, report_to=[], use_cpu=True, bf16=False,
                      logging_steps=1, save_strategy="no", beta=0.0, seed=0, use_vllm=True, vllm_mode="colocate",
                      vllm_max_model_length=128, vllm_importance_sampling_correction=False, disable_tqdm=True)
    trainer = OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args,
                                   train_dataset=arithmetic_dataset(64), processing_class=tok,
                                   correction={"name": "tis", "upper": 2.0})
    trainer.train()
    steps = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
    sync, check = trainer.offpolicy_sync, trainer.offpolicy_sync.check
    from offpolicy.rollout.scoring import sequence_logprobs

    push_s, check_s, engine_s, trainer_s = [], [], [], []
    probe = check.probe
    for _ in range(cli.repeats):
        start = time.perf_counter()
        sync.push()
        push_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        check.after_sync(sync._scorer(), trainer.model, what="timing")
        check_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        sync._scorer().score(probe.prompt_ids, probe.completion_ids)
        engine_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        with torch.no_grad():
            sequence_logprobs(trainer.model, probe.prompt_ids, probe.completion_ids)
        trainer_s.append(time.perf_counter() - start)
    push, chk = statistics.median(push_s), statistics.median(check_s)
    step = statistics.median(steps[1:]) if len(steps) > 1 else steps[0]
    print(f"probe: {check.probe.n_tokens} tokens in {len(check.probe.prompt_ids)} rows; {cli.repeats} repeats")
    print(f"push  median {push:.3f} s  (min {min(push_s):.3f})")
    print(f"check median {chk:.3f} s  (min {min(check_s):.3f})  = {chk / push:.2f}× the push; of it, vLLM scoring the "
          f"probe {statistics.median(engine_s):.3f} s, the trainer {statistics.median(trainer_s):.3f} s")
    print(f"TRL step median {step:.2f} s (steps 2…{len(steps)}): the check is {100 * chk / step:.1f} % of a step")


if __name__ == "__main__":
    main()
