"""verl 0.9.1's actor path on the CPU: what a CPU run lacks, a ``TrainingWorker`` (FSDP2, fp32) on a tiny random
Qwen2, a gloo process group, and a batch trained through ``train_mini_batch`` — the harness of the verl tests
(tests/integrations/test_verl_*.py), benchmarks/verl_overhead.py and tests/vllm/scripts/verl_server.py.

verl assumes an accelerator; nothing in verl is changed, the harness supplies what a CPU run lacks:

* a ``cpu`` platform (verl's platform registry has cuda/npu/rocm only and otherwise falls back to cuda),
* the FSDP language-model engine registered for that device (verl registers it for cuda and npu),
* ``attn_implementation="eager"`` and ``use_remove_padding=False`` (the defaults need flash-attention),
* fp32 parameters (the default bf16 autocast would compare two losses on rounded log-probs),
* verl's TRL check switched off (it patches ``AutoModelForCausalLMWithValueHead``, which TRL ≥ 1.0 no longer has),
* ``temperature`` in the batch's ``meta_info``, as verl's trainer puts it there.

The batch's shape is an :class:`ActorBatch` (a benchmark makes its own), never module state.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field

import torch

from offpolicy.rollout.processes import free_port


def cpu_platform():
    """verl's platform interface on the CPU: ``torch.cpu`` for the device module, gloo for communication, no IPC (a
    weight sender then takes shared memory, as on NPUs)."""
    from verl.plugin.platform.platform_base import PlatformBase

    class CPUDeviceModule:
        """``torch.cpu`` plus the memory and name queries verl logs (no such counters on CPU)."""

        max_memory_allocated = max_memory_reserved = memory_allocated = memory_reserved = staticmethod(lambda *_: 0)
        mem_get_info = staticmethod(lambda *_: (0, 0))
        get_device_name = staticmethod(lambda *_: "CPU")
        get_rng_state = staticmethod(lambda *_: torch.get_rng_state())  # verl's checkpoints save the device RNG
        set_rng_state = staticmethod(lambda state, *_: torch.set_rng_state(state))

        def __getattr__(self, name):
            return getattr(torch.cpu, name)

    class CPUPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = CPUDeviceModule()

        def is_available(self):
            return True

        def is_platform_available(self, use_smi_check=False):
            return True

        def current_device(self):
            return "cpu"  # verl moves tensors .to(current_device())

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg):
            return contextlib.nullcontext()

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    return CPUPlatform()


def tiny_qwen2(path, vocab: int = 64) -> str:
    """A tiny random Qwen2 (2 layers, hidden 32, vocabulary ``vocab``) saved to ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def setup_cpu_verl() -> None:
    """What a CPU run lacks (module docstring); idempotent."""
    from verl.plugin.platform import platform_manager

    platform_manager.set_platform(cpu_platform())  # before verl's engine modules read the device at import

    import verl.models.transformers.monkey_patch as verl_patches
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    verl_patches.is_trl_available = lambda: False
    if "cpu" not in EngineRegistry._engines["language_model"]["fsdp2"]:
        EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
            FSDPEngineWithLMHead
        )


def make_worker(path: str, offpolicy: dict | None = None, lr: float = 0.0, micro: int = 4,
                remove_padding: bool = False, compute_dtype: str = "fp32"):
    """A verl ``TrainingWorker`` (FSDP2, fp32 weights) on the model at ``path``, gradients recorded in
    ``worker.grads``; ``compute_dtype="bf16"``: FSDP2's mixed precision computes the forward and backward in bf16, as
    verl does by default.

    ``offpolicy=None``: verl's own engine. A dict: the user's setup — ``external_lib`` names the plug-in (which
    registers its engine for this device and vendor) and the dict is the ``OFFPOLICY_VERL`` settings block."""
    from verl.workers.config import (
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        TrainingWorkerConfig,
    )
    from verl.workers.engine_workers import TrainingWorker

    override = {"attn_implementation": "eager"}
    fp32 = {"param_dtype": compute_dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    training = TrainingWorkerConfig(
        model_type="language_model",
        model_config=HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=remove_padding,
                                   override_config=override,
                                   external_lib=None if offpolicy is None else "offpolicy.integrations.verl.plugin"),
        engine_config=FSDPEngineConfig(strategy="fsdp2", forward_only=False, mixed_precision=fp32,
                                       use_dynamic_bsz=False, micro_batch_size_per_gpu=micro,
                                       infer_micro_batch_size_per_gpu=micro),
        optimizer_config=FSDPOptimizerConfig(lr=lr, clip_grad=1e9),
        checkpoint_config=None,
    )
    # the plug-in's engine is registered for (cpu, cpu); an unknown vendor falls back to verl's device-only entry
    env = {"VERL_ENGINE_VENDOR": "verl-own-engine"} if offpolicy is None else {"OFFPOLICY_VERL": json.dumps(offpolicy)}
    with environment(env):
        w = TrainingWorker(training)
    w.reset()
    w.grads = []
    step = w.engine.optimizer_step

    def record_gradient_then_step():  # the gradient the update would use, flattened, before the optimizer
        w.grads.append(torch.cat([p.grad.full_tensor().flatten() for p in w.engine.module.parameters()]))
        return step()

    w.engine.optimizer_step = record_gradient_then_step
    return w


@contextlib.contextmanager
def environment(env: dict):
    """``os.environ`` updated with ``env`` inside, restored afterwards (the job environment Ray gives verl's workers)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def process_group(rank: int = 0, world_size: int = 1, port: int | None = None):
    """A gloo process group with the environment verl reads, restored afterwards."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port or free_port()), "RANK": str(rank),
           "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}
    with environment(env):
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            yield
        finally:
            torch.distributed.destroy_process_group()


@dataclass
class ActorBatch:
    """``b`` sequences of ``p`` prompt + ``r`` response tokens over a vocabulary of ``vocab``, trained in micro-batches
    of ``micro``; ``lengths`` [b]: each response's length, ``advantages`` [b]: each sequence's advantage. The default
    is the verl tests' batch: two micro-batches per mini-batch, so the global counts (not the micro-batch's) must set
    the loss's scale; row 1 has left padding in its prompt."""

    b: int = 8
    p: int = 4
    r: int = 6
    vocab: int = 64
    micro: int = 4
    lengths: torch.Tensor = field(default_factory=lambda: torch.tensor([6, 5, 3, 1, 6, 2, 4, 6]))
    advantages: torch.Tensor = field(default_factory=lambda: torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.5, 2.0, -1.0]))

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) [b, p + r]: random ids (seed 1), responses cut to ``lengths``, row 1's prompt
        left-padded by 2."""
        g = torch.Generator().manual_seed(1)
        input_ids = torch.randint(0, self.vocab, (self.b, self.p + self.r), generator=g)
        attention_mask = torch.ones(self.b, self.p + self.r, dtype=torch.long)
        for i, length in enumerate(self.lengths.tolist()):
            attention_mask[i, self.p + length:] = 0
        attention_mask[1, :2] = 0  # left padding
        return input_ids, attention_mask

    def batch(self, tensors: dict, meta: dict, rows: slice = slice(None)):
        """verl's trainer-side batch (``DataProto`` → no-padding ``TensorDict``) as ``_update_actor`` builds it;
        ``rows`` selects a data-parallel rank's share (``tensors`` are given for those rows only)."""
        from verl import DataProto
        from verl.workers.utils.padding import left_right_2_no_padding

        input_ids, attention_mask = (t[rows] for t in self.inputs())
        data = DataProto.from_single_dict(
            {"input_ids": input_ids, "prompts": input_ids[:, :self.p], "attention_mask": attention_mask,
             "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "responses": input_ids[:, self.p:],
             "response_mask": attention_mask[:, self.p:], **tensors},
            meta_info={"temperature": 1.0, "global_token_num": attention_mask.sum(-1).tolist(), **meta},
        )
        return left_right_2_no_padding(data.to_tensordict())

    def infer_logp(self, worker, meta: dict | None = None, rows: slice = slice(None)) -> torch.Tensor:
        """The worker's log-probs of the responses [b, r] from ``infer_batch`` (verl's old-log-prob forward), 0 at
        padding."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        data = self.batch({}, {"compute_loss": False, **(meta or {})}, rows)
        logp = no_padding_2_padding(tu.get(worker.infer_batch(data), "log_probs"), data).float()
        return logp * self.inputs()[1][rows, self.p:]

    def train(self, worker, loss_mode: str, agg: str, tensors: dict, *, mini: int | None = None, epochs: int = 1,
               meta: dict | None = None, seen: list | None = None, rows: slice = slice(None), prepare=None,
               output_keys: list | None = None, clip_ratio_c: float = 3.0):
        """One ``train_mini_batch`` of the whole batch in mini-batches of ``mini`` (default ``b``: one mini-batch, two
        micro-batches in the default shape): (metrics, gradient of each optimiser step). ``seen`` collects the
        log-probs [micro, r] each loss call received, ``output_keys`` the keys of each model output; ``prepare(data)``
        may add fields to the batch; ``clip_ratio_c`` is the dual clip."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.config import FSDPActorConfig
        from verl.workers.utils.losses import ppo_loss
        from verl.workers.utils.padding import no_padding_2_padding

        mini = self.b if mini is None else mini
        actor = FSDPActorConfig(strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=mini,
                                ppo_micro_batch_size_per_gpu=self.micro, loss_agg_mode=agg,
                                policy_loss={"loss_mode": loss_mode}, clip_ratio=0.2, clip_ratio_c=clip_ratio_c)

        def loss(model_output, data, dp_group=None):
            if seen is not None:
                seen.append(no_padding_2_padding(model_output["log_probs"], data).detach().float().clone())
            if output_keys is not None:
                output_keys.append(sorted(model_output))
            return ppo_loss(actor, model_output, data, dp_group)

        worker.set_loss_fn(loss)
        data = self.batch(tensors, meta or {}, rows)
        if prepare is not None:
            data = prepare(data)
        tu.assign_non_tensor(data, global_batch_size=mini, mini_batch_size=mini, epochs=epochs, seed=0,
                             dataloader_kwargs={"shuffle": False}, compute_loss=True, calculate_entropy=False)
        worker.grads.clear()
        metrics = tu.get(worker.train_mini_batch(data), "metrics")
        grads = list(worker.grads)
        return metrics, (grads[0] if len(grads) == 1 else grads)

    def reference_logits(self, worker) -> torch.Tensor:
        """The logits [b, r, V] that predict each response token, from the engine's own module on the padded batch."""
        input_ids, attention_mask = self.inputs()
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = worker.engine.module(input_ids=input_ids, attention_mask=attention_mask,
                                          position_ids=position_ids).logits.float()
        return logits[:, self.p - 1:self.p + self.r - 1]
