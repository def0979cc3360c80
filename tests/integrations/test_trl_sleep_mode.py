"""The TRL sync check under ``vllm_enable_sleep_mode``: driven by TRL 1.16's own code — ``GRPOTrainer.
_generate_single_turn`` and ``VLLMGeneration.sync_weights`` / ``generate`` — against a stand-in for a sleeping
``vllm.LLM`` (vLLM's CPU build has no sleep mode). The check must never score the probe or read the engine's tensors
while weights or KV cache sleep, must leave the engine as TRL expects it, and must still catch a broken push."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
vllm_generation = pytest.importorskip("trl.generation.vllm_generation")
grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")

from offpolicy.integrations.trl.vllm_sync import TRLSyncCheck, awake_for_probe, sleeps  # noqa: E402
from offpolicy.models.tiny import build_tiny_model  # noqa: E402
from offpolicy.rollout.sync_check import SyncCheck, SyncCheckError  # noqa: E402


class Asleep(RuntimeError):
    """The engine was used while memory it needs sleeps."""


class SleepingLLM:
    """A stand-in for ``vllm.LLM``'s sleep mode with vLLM 0.32's semantics (``vllm/entrypoints/llm.py``
    ``LLM.sleep`` / ``wake_up`` / ``release_kv_cache_memory``, ``vllm/v1/engine/core.py`` ``EngineCore.sleep`` /
    ``wake_up``, ``vllm/v1/executor/abstract.py`` ``Executor.sleep`` / ``wake_up``):

    * ``sleep(level >= 1)`` pauses scheduling; level 1 offloads the weights to host memory, level 2 discards them;
      the KV cache is discarded at both; while the weights sleep a second ``sleep`` does nothing (vLLM warns
      "Executor is already sleeping"). ``sleep(level=0)`` only pauses scheduling.
    * ``wake_up(tags)`` maps the tagged memory back: level-1 weights with their contents, level-2 weights as
      garbage (NaN here) until a push writes them; if a tag is not asleep the call does nothing (vLLM warns); the
      scheduler resumes once nothing sleeps; returns whether the engine is fully awake.
    * ``release_kv_cache_memory()`` (from a completed level-0 pause, all memory resident) discards the KV cache.
    * A request while anything sleeps or scheduling is paused: vLLM queues it and the synchronous ``LLM.generate``
      spins forever (the paused scheduler never schedules it while the output processor counts it as unfinished,
      ``vllm/entrypoints/common/offline.py`` ``_run_engine``); here it **raises** :class:`Asleep`, so a test fails
      instead of hanging. Reading or writing the weights while they sleep (unmapped device memory on a GPU: an
      illegal address) raises too.

    ``push_works=False``: ``load_weights`` returns without writing (a broken push)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = build_tiny_model(seed=0)[0]
        self.model.load_state_dict(model.state_dict())
        self.sleeping: set[str] = set()
        self.paused = False
        self.backup: dict[str, torch.Tensor] | None = None
        self.push_works = True
        self.events: list[str] = []
        self.llm_engine = SimpleNamespace(is_sleeping=self.is_sleeping,
                                          model_executor=SimpleNamespace(driver_worker=SimpleNamespace(
                                              model_runner=SimpleNamespace(model=_EngineModel(self)))))

    def is_sleeping(self) -> bool:
        return self.paused or bool(self.sleeping)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.events.append(f"sleep({level})")
        self.paused = True
        if level < 1 or "weights" in self.sleeping:
            return
        with torch.no_grad():
            self.backup = {k: v.clone() for k, v in self.model.state_dict().items()} if level == 1 else None
            for p in self.model.parameters():
                p.fill_(float("nan"))  # the device memory is gone (level 2) or holds no copy (level 1)
        self.sleeping |= {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.events.append(f"wake_up({','.join(tags or ['all'])})")
        tags = list(tags) if tags else sorted(self.sleeping)
        if self.sleeping and all(t in self.sleeping for t in tags):
            if "weights" in tags and self.backup is not None:
                self.model.load_state_dict(self.backup)
                self.backup = None
            self.sleeping -= set(tags)
        if not self.sleeping:
            self.paused = False
        return not self.sleeping

    def release_kv_cache_memory(self) -> None:
        self.events.append("release_kv_cache_memory")
        if not self.paused or self.sleeping:
            raise RuntimeError("release_kv_cache_memory() requires a completed pause and resident memory")
        self.sleeping.add("kv_cache")

    def reset_prefix_cache(self) -> None:
        pass

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        if self.is_sleeping():
            raise Asleep(f"generate while {sorted(self.sleeping) or 'scheduling'} sleeps")
        self.events.append("prompt_logprobs" if sampling_params.prompt_logprobs is not None else "generate")
        outs = []
        for prompt in prompts:
            ids = list(prompt["prompt_token_ids"])
            with torch.no_grad():
                logp = self.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            entries = [None] + [{t: SimpleNamespace(logprob=float(logp[j, t]), rank=1)}
                                for j, t in enumerate(ids[1:])]
            token = int(logp[-1].argmax())
            completion = SimpleNamespace(token_ids=[token],
                                         logprobs=[{token: SimpleNamespace(logprob=float(logp[-1, token]), rank=1)}])
            outs.append(SimpleNamespace(prompt_token_ids=ids, prompt_logprobs=entries, outputs=[completion]))
        return outs


class _EngineModel:
    """The engine's model as TRL's push and the parameter layer reach it; refuses sleeping weights."""

    def __init__(self, llm: SleepingLLM) -> None:
        self.llm = llm

    def _awake(self, what: str) -> None:
        if "weights" in self.llm.sleeping:
            raise Asleep(f"{what} while the weights sleep")

    def load_weights(self, weights) -> None:
        self._awake("load_weights")
        own = dict(self.llm.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                if self.llm.push_works:
                    own[name].copy_(tensor)
        if self.llm.events[-1:] != ["push"]:  # TRL pushes one parameter per call: one event per push
            self.llm.events.append("push")

    def named_parameters(self):
        self._awake("reading the engine's tensors")
        self.llm.events.append("read tensors")
        return self.llm.model.named_parameters()


def _generation(model, llm):
    """TRL's ``VLLMGeneration`` in colocate sleep mode, as its ``__init__`` leaves it (the LLM built, then put to
    sleep at level 2), without building a vLLM engine."""
    gen = object.__new__(vllm_generation.VLLMGeneration)
    gen.model, gen.llm, gen.mode, gen.enable_sleep_mode = model, llm, "colocate", True
    gen.accelerator = SimpleNamespace(is_main_process=True, device=torch.device("cpu"), process_index=0)
    gen._dist = SimpleNamespace(is_fsdp=False, gather_params=lambda params: nullcontext())
    gen.tensor_parallel_size, gen.structured_outputs_regex, gen.generation_kwargs = 1, None, {}
    gen.temperature, gen.top_p, gen.top_k, gen.min_p, gen.repetition_penalty = 1.0, 1.0, -1, None, 1.0
    gen.max_completion_length, gen.logprobs = 1, 0
    llm.sleep(level=2)  # VLLMGeneration.__init__: "if self.enable_sleep_mode: self.llm.sleep(level=2)"
    gen._llm_weights_sleeping = True
    return gen


def _trainer(model, gen, check):
    """What ``GRPOTrainer._generate_single_turn`` reads of its trainer, with the sync check installed as
    ``install_vllm_sync`` installs it (TRL's own ``sync_weights`` as the push)."""
    logged: list[dict] = []
    trainer = SimpleNamespace(use_vllm=True, vllm_generation=gen, _last_loaded_step=-1,
                              state=SimpleNamespace(global_step=0), accelerator=gen.accelerator,
                              args=SimpleNamespace(report_to=[]))
    hook = TRLSyncCheck(gen, model, check, push=gen.sync_weights, step=lambda: trainer.state.global_step,
                        log=logged.append, tokenizer=build_tiny_model(seed=0)[1])
    gen.sync_weights = hook
    return trainer, hook, logged


def _generate(trainer, prompts=((5, 6, 7),)):
    """One of TRL's generations: its trainer's own ``_generate_single_turn`` (sync when the step changed, then
    ``VLLMGeneration.generate``, which re-pushes if the weights slept)."""
    return grpo_trainer.GRPOTrainer._generate_single_turn(trainer, [list(p) for p in prompts], None, {}, 1)


def _train_step(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=0.02)


def test_the_check_never_touches_a_sleeping_engine_over_trls_own_step_order():
    model, _ = build_tiny_model(seed=0)
    llm = SleepingLLM(model)
    gen = _generation(model, llm)
    assert sleeps(gen)
    trainer, hook, logged = _trainer(model, gen, SyncCheck())
    for step in range(3):
        trainer.state.global_step = step
        if step:
            _train_step(model, seed=step)
        for _ in range(2):  # two generations per step: the second re-pushes after the level-2 sleep
            completion_ids, _ = _generate(trainer)
            assert len(completion_ids) == 1
        assert llm.sleeping == {"weights", "kv_cache"}  # TRL sleeps it after every generation, as without the check
    # every sync checked (2 per step: TRL re-pushes discarded weights before each generation), all passed
    assert len(logged) == 6 and all(m["sync/ok"] == 1.0 for m in logged)
    assert logged[0]["sync/baseline"] < 1e-6  # calibrated after the first push (fp32 on both sides)
    assert "sync/params_checked" in logged[-1]  # the parameter layer ran, on awake tensors
    # the order of one sync: push with the weights awake, KV cache woken for the probe and released again,
    # then TRL's own wake-up and generation
    first = llm.events[llm.events.index("push"):]
    assert first[:3] == ["push", "wake_up(kv_cache)", "read tensors"]
    probe_end = first.index("release_kv_cache_memory")
    assert first[probe_end - 2:probe_end + 4] == ["prompt_logprobs", "sleep(0)", "release_kv_cache_memory",
                                                   "wake_up(kv_cache)", "generate", "sleep(2)"]


def test_a_broken_push_under_sleep_mode_is_caught():
    model, _ = build_tiny_model(seed=0)
    llm = SleepingLLM(model)
    trainer, hook, logged = _trainer(model, _generation(model, llm), SyncCheck())
    _generate(trainer)
    trainer.state.global_step = 1
    _train_step(model, seed=1)
    llm.push_works = False  # the engine woke its weights but the push wrote nothing: it kept last step's
    with pytest.raises(SyncCheckError, match="vLLM weight sync at step 1"):
        _generate(trainer)
    assert not llm.is_sleeping() or "weights" not in llm.sleeping  # failed on awake tensors, not by touching asleep


def test_a_first_push_that_writes_nothing_fails_calibration():
    # level 2 discarded the weights at start-up: a first push that writes nothing leaves garbage the check refuses
    model, _ = build_tiny_model(seed=0)
    llm = SleepingLLM(model)
    llm.push_works = False
    trainer, _, _ = _trainer(model, _generation(model, llm), SyncCheck())
    with pytest.raises(SyncCheckError, match="different models"):
        _generate(trainer)


def test_weights_still_asleep_after_the_push_are_refused_without_reading_them():
    model, _ = build_tiny_model(seed=0)
    llm = SleepingLLM(model)
    gen = _generation(model, llm)
    with pytest.raises(SyncCheckError, match="weights still sleep after the push"):
        with awake_for_probe(gen):
            pass
    assert llm.sleeping == {"weights", "kv_cache"} and "read tensors" not in llm.events


def test_without_sleep_mode_the_engine_is_not_woken_or_released():
    model, _ = build_tiny_model(seed=0)
    llm = SleepingLLM(model)
    gen = SimpleNamespace(mode="colocate", enable_sleep_mode=False, llm=llm)
    with awake_for_probe(gen):
        pass
    assert llm.events == []


def test_a_vllm_without_release_kv_cache_memory_keeps_the_kv_cache_awake_and_trl_still_generates():
    class OlderLLM(SleepingLLM):
        release_kv_cache_memory = None  # before vLLM had it: the probe's KV cache stays awake until TRL sleeps

    model, _ = build_tiny_model(seed=0)
    llm = OlderLLM(model)
    trainer, _, logged = _trainer(model, _generation(model, llm), SyncCheck())
    _generate(trainer)
    assert logged[-1]["sync/ok"] == 1.0 and "sleep(0)" not in llm.events
    assert llm.events[-3:] == ["wake_up(kv_cache)", "generate", "sleep(2)"]  # TRL's wake-up found nothing asleep
