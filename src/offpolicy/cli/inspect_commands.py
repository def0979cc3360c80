"""``offpolicy inspect``: a rollout engine against a trainer on one model (and ``--check-sync``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.markup import escape

from offpolicy.cli.base import failing, make_console, make_dir, warnings_on
from offpolicy.cli.output import check_gate, print_inspection


def inspect_command(
    model: str = typer.Option("tiny", "--model", help="tiny, lab or lab-moe (embedded, warm-started), tiny-random, or "
                              "a local model directory (nothing is downloaded)."),
    beside: str | None = typer.Option(None, "--beside", help="Also measure this model (same forms as --model) with "
                                      "the same engines and prompts, and report this one's KL and k3 over it "
                                      "(default: lab for --model lab-moe; 'none' for nothing)."),
    out: Path = typer.Option(Path("offpolicy-inspect"), "--out", help="Folder for report.html/.json, PNGs, tokens.jsonl."),
    rollout: list[str] | None = typer.Option(None, "--rollout", help="Rollout engine spec: a built-in (bf16, fp16, "
                                                "fp32, fp32-head, int8, int4, kv8, kv4, w8kv8, noise; activation-quantised: fp8, "
                                                "fp8-dynamic, fp8-block, mxfp8, w4a16, w4a4) and/or key=value pairs, "
                                                "e.g. 'bf16,weight_bits=4,quantize_layers=2' or 'backend=hf,quant=w4a4'. "
                                                "Repeatable."),
    trainer: list[str] | None = typer.Option(None, "--trainer", help="Trainer spec: fp32 (default), bf16-autocast, "
                                                "fp16-autocast, bf16, fp16, and/or key=value pairs. One for every "
                                                "--rollout, or one for all."),
    task: str = typer.Option("arithmetic", "--task", help="Prompt source: arithmetic, countdown or a .jsonl file."),
    prompts: int = typer.Option(64, "--prompts", min=1, help="Number of prompts."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1, help="Tokens sampled per prompt (at most)."),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature."),
    top_k: int | None = typer.Option(None, "--top-k", help="Sampling top-k."),
    top_p: float | None = typer.Option(None, "--top-p", help="Sampling top-p."),
    min_p: float | None = typer.Option(None, "--min-p", help="Sampling min-p."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Sample exactly --max-new-tokens per prompt."),
    seed: int = typer.Option(0, "--seed", help="Seed of the prompts and the sampling."),
    topk: int = typer.Option(20, "--topk", min=1, help="Width of the top-k overlap and of the stored top-k log-probs."),
    layers: bool = typer.Option(True, "--layers/--no-layers", help="Per-layer localisation (a second forward)."),
    layer_threshold: float = typer.Option(1e-3, "--layer-threshold", help="Relative error at which a layer counts "
                                          "as divergent."),
    rollout_view: str = typer.Option("full", "--rollout-view", help="full (the engine's logits) or topk (only its "
                                     "top-k log-probs, as vLLM reports)."),
    sample_with: str | None = typer.Option(None, "--sample-with", help="Take the tokens from this engine spec and "
                                              "let each --rollout score them: engines compared on identical "
                                              "sequences (a paired comparison)."),
    memory_budget_mb: int = typer.Option(2048, "--memory-budget-mb", min=16, help="Logits held at once (micro-batch "
                                         "size follows from it)."),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch intra-op threads (default: 1 for the "
                                          "embedded tiny models, whose matmuls are too small to share; torch's "
                                          "otherwise)."),
    fail_above: str | None = typer.Option(None, "--fail-above", help="CI gate, e.g. kl=1e-3,max_kl=0.05: exit 1 "
                                             "when a report.json metric exceeds its bound."),
    check_sync: float | None = typer.Option(None, "--check-sync", help="Only check that the engine holds --model's "
                                            "weights (after a reload): an error when the mean |Δ log p| on a probe "
                                            "exceeds this many nats per token (the engine's own numerics set it: "
                                            "1e-3 for an fp32 engine, 0.05 for bf16); no report."),
) -> None:
    """Measure a model's training–inference mismatch: full distributions, per layer, thresholds that check themselves."""
    from offpolicy.inspect.gate import parse_bounds
    from offpolicy.inspect.specs import parse_spec
    from offpolicy.rollout.sampling import SamplingConfig

    console = make_console()
    with failing(console):  # every argument checked before any work
        rollouts = [parse_spec(r, "rollout") for r in (rollout or ["bf16"])]
        trainers = [parse_spec(t, "trainer") for t in (trainer or ["fp32"])]
        if len(trainers) not in (1, len(rollouts)):
            raise ValueError(f"--trainer: give one, or one per --rollout ({len(rollouts)}), not {len(trainers)}")
        pairs = list(zip(rollouts, trainers * len(rollouts) if len(trainers) == 1 else trainers))
        sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                  min_p=min_p)
        bounds = parse_bounds(fail_above) if fail_above else None
        sampler = parse_spec(sample_with, "rollout") if sample_with else None
        if rollout_view not in ("full", "topk"):
            raise ValueError(f"--rollout-view must be full or topk, got {rollout_view!r}")
        if not (layer_threshold > 0 and layer_threshold < float("inf")):
            raise ValueError(f"--layer-threshold must be a finite number > 0, got {layer_threshold!r}")
    if check_sync is not None:
        _check_sync(console, model, rollouts, task=task, prompts=prompts, seed=seed, tolerance=check_sync,
                    max_new_tokens=max_new_tokens)
        return
    make_dir(console, out, "--out")
    threads_before = torch.get_num_threads()
    from offpolicy.inspect.run import EMBEDDED

    if threads is None and model in (*EMBEDDED, "tiny-random"):
        threads = 1  # as the demo: on a shared 2-core machine a second thread mostly spins (measured 2-5x slower)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with failing(console), warnings_on(console):
            beside_model = (("lab" if model == "lab-moe" else None) if beside is None
                            else None if beside == "none" else beside)
            summaries = _inspect_runs(console, model, out, pairs, sampling, task=task, prompts=prompts, seed=seed,
                                      beside=beside_model,
                                      ignore_eos=ignore_eos, topk=topk, layers=layers, layer_threshold=layer_threshold,
                                      rollout_view=rollout_view, budget=memory_budget_mb << 20, sampler=sampler)
    finally:
        torch.set_num_threads(threads_before)
    check_gate(console, summaries, bounds)


def _check_sync(console: Console, model_path: str, rollouts, *, task: str, prompts: int, seed: int,  # noqa: ANN001
                tolerance: float, max_new_tokens: int) -> None:
    """``inspect --check-sync``: does each engine hold the model's weights? A probe (8 of the task's prompts, answered
    by the engine) scored by the engine and by the trainer; one line per engine, exit 1 on the first that does not."""
    from offpolicy.inspect.compare import _rollout_engine
    from offpolicy.inspect.run import load_model, task_prompts
    from offpolicy.rollout.sampling import SamplingConfig
    from offpolicy.rollout.sync_check import SyncCheck, SyncProbe

    with failing(console):
        if not tolerance > 0:
            raise ValueError(f"--check-sync must be a number of nats > 0, got {tolerance!r}")
        model, tokenizer = load_model(model_path)
        local = str(Path(model_path)) if Path(model_path).is_dir() else None
        prompt_ids = task_prompts(tokenizer, task, min(prompts, 8), seed=seed)
        for spec in rollouts:
            engine = _rollout_engine(model, spec, tokenizer, local, 1, full=False)
            out = engine.generate(prompt_ids, SamplingConfig(max_new_tokens=min(max_new_tokens, 32)), seed=seed)
            check = SyncCheck(max_baseline=tolerance)
            metrics = check.calibrate(engine, model, SyncProbe.from_rollout(out.prompt_ids, out.completion_ids))
            console.print(f"sync OK: {spec.describe()} holds {model_path}'s weights: mean |Δ log p| "
                          f"{metrics['sync/gap']:.3g} nats per token ≤ {tolerance:g} on "
                          f"{check.probe.n_tokens if check.probe else 0} probe tokens", soft_wrap=True)


def _inspect_runs(console: Console, model_path: str, out: Path, pairs, sampling, *, task: str, prompts: int,  # noqa: ANN001
                  seed: int, ignore_eos: bool, topk: int, layers: bool, layer_threshold: float, rollout_view: str,
                  budget: int, sampler=None, beside: str | None = None) -> list[dict]:  # noqa: ANN001
    from offpolicy.inspect.dump import write_dump
    from offpolicy.inspect.report import markdown_table, write_report
    from offpolicy.inspect.routing_flips import beside_numbers
    from offpolicy.inspect.run import EMBEDDED, inspect_engines, load_model, task_prompts
    from offpolicy.inspect.summary import summarize

    t0 = time.perf_counter()
    local = model_path if Path(model_path).is_dir() else None
    if model_path in EMBEDDED:
        from offpolicy.models import get_recipe, model_dir
        from offpolicy.models import model_path as embedded_path

        if not model_dir(get_recipe(model_path)).is_dir():
            console.print(f"[bold]warm start[/bold] of the embedded {model_path} model (cached after the first run) …")
        local = str(embedded_path(model_path))  # its directory, for an engine that loads it itself (vLLM)
    model, tokenizer = load_model(model_path)
    prompt_ids = task_prompts(tokenizer, task, prompts, seed=seed)
    other = load_model(beside) if beside is not None else None  # its tokenizer must encode the prompts the same way
    if other is not None and task_prompts(other[1], task, prompts, seed=seed) != prompt_ids:
        raise ValueError(f"--beside {beside!r}: its tokenizer encodes the prompts otherwise than {model_path!r}'s")
    summaries = []
    for rollout, trainer in pairs:
        folder = out if len(pairs) == 1 else out / f"{rollout.name}__{trainer.name}".replace("/", "_")
        console.print(f"[bold]inspect[/bold] rollout {escape(rollout.describe())} vs trainer "
                      f"{escape(trainer.describe())}: {len(prompt_ids)} prompts × ≤{sampling.max_new_tokens} tokens",
                      soft_wrap=True)
        measured = inspect_engines(model, prompt_ids, rollout, trainer, sampling, tokenizer=tokenizer, seed=seed,
                                   ignore_eos=ignore_eos, topk=topk, rollout_view=rollout_view, layers=layers,
                                   layer_threshold=layer_threshold, memory_budget_bytes=budget, model_path=local,
                                   sample_with=sampler)
        measured.meta.update({"model": model_path, "task": task})
        if other is not None:
            console.print(f"[bold]beside[/bold] {escape(str(beside))}: the same engines and prompts")
            dense = inspect_engines(other[0], prompt_ids, rollout, trainer, sampling, tokenizer=other[1], seed=seed,
                                    ignore_eos=ignore_eos, topk=topk, rollout_view=rollout_view, layers=False,
                                    memory_budget_bytes=budget, sample_with=sampler, dvp_rhos=None)
            measured.meta["beside"] = beside_numbers(summarize(dense), str(beside))
        summary = write_report(measured, folder)
        write_dump(measured, folder / "tokens.jsonl")
        print_inspection(console, summary, folder)
        summaries.append(summary)
    if len(pairs) > 1:
        (out / "table.md").write_text(markdown_table(summaries))
        console.print(f"mismatch table: {escape(str(out / 'table.md'))}")
    console.print(f"total wall time {time.perf_counter() - t0:.1f} s")
    return summaries
