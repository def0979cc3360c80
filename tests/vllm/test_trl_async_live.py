"""``OffPolicyAsyncGRPOTrainer`` in TRL 1.16's own asynchronous ``train()`` against a live vLLM server (vLLM's CPU
build, the embedded tiny model in float32 on both sides): completions and μ from the server's ``/v1/completions``
(``offpolicy_testkit.async_trl.VLLMRolloutWorker``, through TRL's ``rollout_worker=`` hook; TRL's own
``AsyncRolloutWorker`` needs a chat template the tiny tokenizer does not have), the trainer's weights into the server
through ``FileWeightTransfer`` (``weight_transfer=``: a reload folder and vLLM's dev-mode reload, where TRL's default
is NCCL). Fresh tokens match the trainer (k3 ≈ 0), stale ones do not, and after ``train()`` the server scores with
the trained weights (≈ 60 s beside a started server)."""

from __future__ import annotations

import math
import os

import pytest
import torch

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
if not trl.__version__.startswith("1.16"):
    pytest.skip(f"plugs into TRL 1.16's trl.experimental.async_grpo; installed {trl.__version__}",
                allow_module_level=True)


def _reward(text, answer):
    return float(sum(map(ord, text)) % 5)  # varies with the text: a group's advantages are not all 0


def test_async_train_against_vllm_with_file_weight_transfer(vllm_servers, tmp_path):
    import datasets
    from offpolicy_testkit.async_trl import VLLMRolloutWorker, cpu_constructor, cpu_tree_attention
    from offpolicy_testkit.trl_toy import logged
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from offpolicy.glossary import lookup
    from offpolicy.integrations.trl import FileWeightTransfer, OffPolicyAsyncGRPOTrainer
    from offpolicy.tasks import get_task

    server = vllm_servers.get("tiny", "float32")
    path = str(server.model_dir)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [(e.prompt, e.answer) for e in get_task("arithmetic").examples(8, seed=0)]
    worker = VLLMRolloutWorker(server.url, path, tok, prompts, _reward, num_generations=4, max_new_tokens=5,
                               samples_per_version=8)
    transfer = FileWeightTransfer(server.url, tmp_path / "reload")
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=5, max_steps=3, report_to=[], use_cpu=True, bf16=False,
                           logging_steps=1, save_strategy="no", token_budget=0, learning_rate=1e-2, seed=0)
    with cpu_constructor():
        trainer = OffPolicyAsyncGRPOTrainer(
            model=path, reward_funcs=lambda **k: [0.0], args=args, processing_class=tok,
            train_dataset=datasets.Dataset.from_list([{"prompt": p} for p, _ in prompts]),
            rollout_worker=worker, weight_transfer=transfer, correction={"name": "tis", "upper": 2.0})
    assert transfer.aliases == {"model.embed_tokens.weight": ["lm_head.weight"]}  # the tied head, bound
    probe = worker._sample_one(tok(prompts[0][0])["input_ids"])  # before training: the server has the start model
    with cpu_tree_attention():
        trainer.train()
    assert transfer.pushes == 4  # the cold sync + one per step
    # every transfer checked against the server's prompt log-probs: fp32 on both sides, round-off only
    assert logged(trainer, "sync/ok") == [1.0, 1.0, 1.0] and max(logged(trainer, "sync/gap")) < 1e-4
    rows = [h for h in trainer.state.log_history if "offpolicy/staleness/mean" in h]
    assert [r["offpolicy/staleness/max"] for r in rows] == [0.0, 1.0, 2.0]  # 16 samples of version 1 queued
    assert rows[0]["offpolicy/staleness/d0/k3_kl"] < 1e-6  # the model the server started on: fp32 both sides
    assert rows[2]["offpolicy/staleness/d2/k3_kl"] > 1e-4  # two updates later the trainer has moved
    ours = {k for h in trainer.state.log_history for k in h if k.startswith(("offpolicy/", "sampling/"))}
    assert [k for k in sorted(ours) if lookup(k) is None] == []
    assert all(math.isfinite(v) for k in ours for v in logged(trainer, k))
    # the last push reached the server: its log-probs of a fixed completion are the trained model's, not the start's
    prompt = tok(prompts[0][0])["input_ids"]
    served = _served_logp(server.url, worker.protocol, prompt, probe[0])
    model = trainer.model.eval()
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + probe[0]])).logits[0, len(prompt) - 1:-1].float()
    trained = torch.log_softmax(logits, -1).gather(1, torch.tensor(probe[0])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(served), trained, atol=1e-4), (served, trained.tolist())
    assert max(abs(a - b) for a, b in zip(served, probe[1])) > 1e-3  # and the start model's were different


def _served_logp(url, protocol, prompt, completion):
    from offpolicy.rollout.http import post_json

    answer = post_json(url + protocol.path, protocol.score_request(prompt, completion), timeout=120, what="score")
    return protocol.parse_score(answer, prompt, completion, where="score")


def test_a_wrong_tensor_written_to_the_reload_folder_is_caught_by_the_sync_check(vllm_servers, tmp_path):
    # the second transfer (after step 1) writes one MLP weight as zeros: vLLM reloads it, and the check after that
    # transfer scores the probe on the server and names the step, the version and the gap
    import datasets
    from offpolicy_testkit.async_trl import TamperedTransfer, VLLMRolloutWorker, cpu_constructor, cpu_tree_attention
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from offpolicy.integrations.trl import FileWeightTransfer, OffPolicyAsyncGRPOTrainer
    from offpolicy.rollout.sync_check import SyncCheckError
    from offpolicy.tasks import get_task

    server = vllm_servers.get("tiny", "float32")
    path = str(server.model_dir)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [(e.prompt, e.answer) for e in get_task("arithmetic").examples(8, seed=0)]
    worker = VLLMRolloutWorker(server.url, path, tok, prompts, _reward, num_generations=4, max_new_tokens=5,
                               samples_per_version=8)
    layer = "model.layers.1.mlp.down_proj.weight"
    transfer = TamperedTransfer(FileWeightTransfer(server.url, tmp_path / "reload"), at_push=2, corrupt=layer)
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=5, max_steps=3, report_to=[], use_cpu=True, bf16=False,
                           logging_steps=1, save_strategy="no", token_budget=0, learning_rate=1e-2, seed=0)
    with cpu_constructor():
        trainer = OffPolicyAsyncGRPOTrainer(
            model=path, reward_funcs=lambda **k: [0.0], args=args, processing_class=tok,
            train_dataset=datasets.Dataset.from_list([{"prompt": p} for p, _ in prompts]),
            rollout_worker=worker, weight_transfer=transfer, correction={"name": "tis", "upper": 2.0})
    assert transfer.inner.aliases == {"model.embed_tokens.weight": ["lm_head.weight"]}  # bound through the wrapper
    try:
        with cpu_tree_attention(), pytest.raises(SyncCheckError) as err:
            trainer.train()
    finally:  # the server is shared by the session: give it back the checkpoint's weights
        start = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        restore = FileWeightTransfer(server.url, tmp_path / "restore")
        restore.bind(start)
        restore.send_weights(iter(start.named_parameters()))
    message = str(err.value)
    assert transfer.tampered == [layer] and transfer.pushes == 2
    assert message.startswith("weight transfer 2 at step 1 (model version 2): after the weight sync the engine's "
                              "log-probs are "), message
    assert "nats per token from the trainer's" in message and "\n" not in message


@pytest.mark.skipif(os.environ.get("OFFPOLICY_LIVE_ASYNC_WORKER") != "1", reason=(
    "opt-in, OFFPOLICY_LIVE_ASYNC_WORKER=1: the async trainer's own rollout-worker process can die after training, and "
    "its stop() then blocks for ever in multiprocessing's Event.set (seen in 2 of 3 runs on 2 CPU cores)"))
def test_trls_own_rollout_worker_against_vllm_with_a_minimal_chat_template(vllm_servers, tmp_path):
    # TRL's default AsyncRolloutWorker (its own process, /v1/completions) with the test kit's minimal chat template
    # on a copy of the tiny tokenizer; the sync check scores the same server after every FileWeightTransfer
    import datasets
    from offpolicy_testkit.async_trl import (
        cpu_constructor,
        cpu_tree_attention,
        length_reward,
        with_minimal_chat_template,
    )
    from offpolicy_testkit.trl_toy import logged
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from offpolicy.integrations.trl import FileWeightTransfer, OffPolicyAsyncGRPOTrainer
    from offpolicy.integrations.trl.async_check import _ServedModel
    from offpolicy.tasks import get_task

    server = vllm_servers.get("tiny", "float32")
    path = str(server.model_dir)
    tok = with_minimal_chat_template(AutoTokenizer.from_pretrained(path))
    prompts = [e.prompt for e in get_task("arithmetic").examples(8, seed=0)]
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=5, max_steps=2, report_to=[], use_cpu=True, bf16=False,
                           logging_steps=1, save_strategy="no", token_budget=0, learning_rate=1e-2, seed=0,
                           vllm_server_base_url=server.url, max_inflight_tasks=4, temperature=1.0,
                           heartbeat_stale_after_s=120)  # a worker process that died fails the test, not hangs it
    transfer = FileWeightTransfer(server.url, tmp_path / "reload")
    with cpu_constructor():
        trainer = OffPolicyAsyncGRPOTrainer(
            model=path, reward_funcs=[length_reward], args=args, processing_class=tok,
            train_dataset=datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts]),
            weight_transfer=transfer, correction={"name": "tis", "upper": 2.0})
    assert isinstance(trainer.rollout_worker, AsyncRolloutWorker)  # TRL's own, not a stand-in
    assert isinstance(trainer.offpolicy_sync.engine, _ServedModel)  # the check scores TRL's server
    try:
        with cpu_tree_attention():
            trainer.train()
    finally:
        trainer.rollout_worker.stop()
    assert trainer.state.global_step == 2 and transfer.pushes == 3  # the cold transfer + one per step
    assert logged(trainer, "sync/ok") == [1.0, 1.0] and max(logged(trainer, "sync/gap")) < 1e-4
    assert all(math.isfinite(v) for v in logged(trainer, "offpolicy/tis/weight_mean"))
    assert logged(trainer, "sampling/k3_kl")[0] < 1e-4  # μ from vLLM, fp32 on both sides
