"""The inspection recipe, top to bottom: load a model, take prompts, compare two engines, localise, report, dump.

``offpolicy inspect`` is this module behind a command line; call :func:`inspect_engines` from Python to get the
:class:`~offpolicy.inspect.measurements.Measurements` of your own model and engines.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from offpolicy.inspect.compare import DVP_RHO_GRID, compare_engines
from offpolicy.inspect.layers import LAYER_THRESHOLD, layer_errors
from offpolicy.inspect.measurements import Measurements
from offpolicy.inspect.routing_flips import recording_routes
from offpolicy.inspect.specs import build_inspect_engine
from offpolicy.inspect.vocabulary import DEFAULT_MEMORY_BUDGET_BYTES
from offpolicy.objectives.base import check_positive
from offpolicy.perturbation import find_decoder_layers
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.spec import EngineSpec

EMBEDDED = ("tiny", "lab", "lab-moe")  # the recipes of offpolicy.models.RECIPES, by name


def load_model(path: str, *, cache_dir: str | None = None):  # -> (model, tokenizer)
    """``"tiny"`` / ``"lab"`` / ``"lab-moe"`` (the embedded warm-started models, built and cached on first use), ``"tiny-random"``
    (random init, seed 0) or a local transformers directory (``local_files_only``: nothing is downloaded). float32,
    eval mode."""
    if path in EMBEDDED:
        from offpolicy.models import get_recipe
        from offpolicy.models import load_model as load_embedded

        return load_embedded(get_recipe(path), cache_dir)
    if path == "tiny-random":
        from offpolicy.models import build_tiny_model

        return build_tiny_model(seed=0)
    local = Path(path).expanduser()
    if not local.is_dir():
        raise ValueError(f"--model {path!r} is not {', '.join(repr(n) for n in (*EMBEDDED, 'tiny-random'))} or a "
                         "local model directory")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(local), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(local), local_files_only=True, dtype=torch.float32)
    return model.eval(), tokenizer


def task_prompts(tokenizer, task: str, n: int, *, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of a built-in task ("arithmetic", "countdown") or a JSONL file, as token ids."""
    from offpolicy.tasks import get_task

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"--prompts must be an int ≥ 1, got {n!r}")
    examples = get_task(task).examples(n, seed=seed)
    ids = [tokenizer(e.prompt)["input_ids"] for e in examples]
    if not all(ids):
        raise ValueError(f"task {task!r}: a prompt tokenised to nothing")
    return ids


def _layer_rows(model: torch.nn.Module, longest: int, budget: int) -> int:
    """Sequences per layer-pass batch: both engines' hidden states at every hook point plus their logits."""
    cfg: Any = model.config  # a transformers config (torch types module attributes as Tensor | Module)
    points = len(find_decoder_layers(model)) + 3
    per_row = 4 * 2 * longest * (points * cfg.hidden_size + 2 * cfg.vocab_size)
    return max(1, budget // per_row)


def inspect_engines(model: torch.nn.Module, prompt_ids: list[list[int]], rollout: EngineSpec, trainer: EngineSpec,
                    sampling: SamplingConfig, *, tokenizer=None, seed: int = 0, ignore_eos: bool = False,
                    topk: int = 20, rollout_view: str = "full", layers: bool = True,
                    layer_threshold: float = LAYER_THRESHOLD, dvp_rhos: tuple[float, ...] | None = DVP_RHO_GRID,
                    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES, model_path: str | None = None,
                    sample_with: EngineSpec | None = None) -> Measurements:
    """:func:`~offpolicy.inspect.compare.compare_engines`, then (``layers``) the per-layer relative errors on the
    same sequences (:func:`~offpolicy.inspect.layers.layer_errors`; not for a vLLM rollout, whose internals are out of
    reach). Arguments as there; ``layer_threshold``: where a layer counts as divergent."""
    check_positive("layer_threshold", layer_threshold)
    t0 = time.perf_counter()
    roll_engine = None
    if rollout.backend == "hf":
        roll_engine = build_inspect_engine(model, recording_routes(model, rollout), tokenizer)
    train_engine = build_inspect_engine(model, trainer)
    engines = (roll_engine, train_engine) if roll_engine is not None else None
    measured = compare_engines(model, prompt_ids, rollout, trainer, sampling, tokenizer=tokenizer, seed=seed,
                               ignore_eos=ignore_eos, topk=topk, rollout_view=rollout_view, dvp_rhos=dvp_rhos,
                               memory_budget_bytes=memory_budget_bytes, model_path=model_path, engines=engines,
                               sample_with=sample_with)
    measured.layer_threshold = layer_threshold
    if layers and roll_engine is not None:
        t1 = time.perf_counter()
        completions = [row[: int(n)] for row, n in zip(measured.tokens.completion_ids.tolist(),
                                                       measured.tokens.lengths.tolist())]
        longest = max(len(p) + len(c) for p, c in zip(prompt_ids, completions))
        autocast = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(trainer.autocast or "")
        measured.layers = layer_errors(roll_engine, train_engine, prompt_ids, completions, trainer_autocast=autocast,
                                       rows_per_batch=_layer_rows(model, longest, memory_budget_bytes))
        measured.meta["timings"]["layers_s"] = time.perf_counter() - t1
    measured.meta["timings"]["total_s"] = time.perf_counter() - t0
    return measured
