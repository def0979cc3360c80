"""TRL's ``rollout_func`` answered by one of offpolicy's rollout engines: a real rollout–trainer mismatch in TRL's own
``GRPOTrainer.train()``, on any machine, without vLLM.

TRL stores the log-probs a ``rollout_func`` returns as ``sampling_per_token_logps`` — the same field vLLM fills —
so :class:`~offpolicy.integrations.trl.OffPolicyGRPOTrainer` reads them as μ and every correction acts on a real
μ ≠ π_old: the engine's bf16 numerics and KV cache (:class:`~offpolicy.rollout.hf.HFRolloutEngine`), llama.cpp's
kernels (:class:`~offpolicy.rollout.llamacpp.LlamaCppRolloutEngine`), or weights that lag the trainer by
``sync_every − 1`` steps, as an asynchronous pipeline's engine does::

    from offpolicy.rollout import EngineSpec
    from offpolicy.integrations.trl import OffPolicyGRPOTrainer, engine_rollout

    trainer = OffPolicyGRPOTrainer(model=model, ..., correction={"name": "tis", "upper": 2.0},
                                   rollout_func=engine_rollout(EngineSpec.parse("dtype=bf16,quant=w4a4"), sync_every=4))

An :class:`~offpolicy.rollout.spec.EngineSpec` is built by the engine factory (:func:`offpolicy.rollout.build_engine`)
on the trainer's model and tokenizer at the first generation; an engine already built is used as it is.

The engine samples with the ``GRPOConfig``'s temperature, ``top_k``, ``top_p``, ``min_p`` and
``max_completion_length``; its weights are copied from the trainer's model at the first generation of every
``sync_every``-th optimiser step (``trainer.state.global_step``). Plain-text prompts only (the engine takes token
ids: a conversational prompt is refused), one process (the engine holds a full copy of the model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from offpolicy.rollout.base import RolloutEngine, RolloutOutput
from offpolicy.rollout.factory import build_engine
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.spec import EngineSpec


def sampling_from_trl(args: Any) -> SamplingConfig:
    """The engine's recipe from a ``GRPOConfig`` (``top_k`` 0 or −1 and ``top_p`` 1 are off, as in TRL).

    >>> from types import SimpleNamespace as A
    >>> sampling_from_trl(A(max_completion_length=8, temperature=0.7, top_k=0, top_p=1.0, min_p=None))
    SamplingConfig(max_new_tokens=8, temperature=0.7, top_k=None, top_p=None, min_p=None, logprobs_topk=0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=(), bad_words_ids=())
    """
    top_k = getattr(args, "top_k", None)
    top_p = getattr(args, "top_p", None)
    min_p = getattr(args, "min_p", None)
    return SamplingConfig(
        max_new_tokens=int(args.max_completion_length),
        temperature=float(getattr(args, "temperature", 1.0) or 1.0),
        top_k=int(top_k) if top_k and top_k > 0 else None,
        top_p=float(top_p) if top_p is not None and top_p < 1.0 else None,
        min_p=float(min_p) if min_p else None,
        repetition_penalty=float(getattr(args, "repetition_penalty", 1.0) or 1.0),
    )


def engine_rollout(engine: RolloutEngine | EngineSpec, *, sync_every: int = 1,
                   seed: int = 0) -> Callable[[list, Any], dict]:
    """A TRL ``rollout_func`` that samples with ``engine`` and reports its log-probs as μ (see the module docstring).

    ``engine``: a rollout engine, or an :class:`~offpolicy.rollout.spec.EngineSpec` that the engine factory builds on
    the trainer's model and tokenizer at the first generation. ``sync_every`` = k: the engine takes the trainer's
    weights at steps 0, k, 2k, … (1: every step — the mismatch is the engine's numerics alone); ``seed``: the first
    generation's seed (then one more per call).
    """
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
    spec = engine if isinstance(engine, EngineSpec) else None
    if spec is None and not (hasattr(engine, "generate") and hasattr(engine, "sync_weights")):
        raise ValueError(f"engine must be an offpolicy rollout engine (generate, sync_weights) or an EngineSpec, got "
                         f"{type(engine).__name__}")
    built: list[Any] = [None if spec is not None else engine]  # the engine, once the factory has built it
    calls = [0]  # generations so far (the next seed is seed + calls)
    synced_at: list[int | None] = [None]  # the step whose weights the engine holds

    def rollout(prompts: list, trainer: Any) -> dict[str, list]:
        if any(not isinstance(p, str) for p in prompts):
            raise ValueError("engine_rollout: prompts must be plain text (the engine takes token ids; a "
                             "conversational prompt needs the chat template applied in your dataset)")
        step = int(getattr(getattr(trainer, "state", None), "global_step", 0) or 0)
        due = step - step % sync_every  # the step whose weights the engine should hold
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        if built[0] is None:
            assert spec is not None
            built[0] = build_engine(spec, model=trainer.model, tokenizer=tokenizer)
        active = built[0]
        if synced_at[0] != due:
            active.sync_weights(trainer.model)
            synced_at[0] = due
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        out = active.generate(prompt_ids, sampling_from_trl(trainer.args), seed=seed + calls[0])
        calls[0] += 1
        logprobs = rollout_logprob_lists(out, where=f"engine_rollout at step {step} (generation {calls[0]})")
        return {"prompt_ids": prompt_ids, "completion_ids": [list(c) for c in out.completion_ids], "logprobs": logprobs}

    return rollout


def rollout_logprob_lists(out: RolloutOutput, *, where: str) -> list[list[float]]:
    """Per completion, μ of each of its tokens (TRL's ``logprobs`` layout) — refusing, naming ``where`` and the
    completion, a rollout with fewer valid log-probs than tokens (TRL would pad the row: μ = 1, a log-prob of 0).

    >>> import torch
    >>> out = RolloutOutput(prompt_ids=[[1]], completion_ids=[[5, 6]], logp=torch.tensor([[-0.5, 0.0]]),
    ...     mask=torch.tensor([[True, False]]))
    >>> rollout_logprob_lists(out, where="step 3")
    Traceback (most recent call last):
    ...
    ValueError: step 3: completion 0 has 2 tokens but 1 log-probs from the engine
    """
    lists = []
    for i, c in enumerate(out.completion_ids):
        n = int(out.mask[i].sum()) if i < out.mask.shape[0] else 0
        if n != len(c) or out.logp.shape[1] < len(c):
            raise ValueError(f"{where}: completion {i} has {len(c)} tokens but {n} log-probs from the engine")
        lists.append(out.logp[i, : len(c)].tolist())
    return lists
