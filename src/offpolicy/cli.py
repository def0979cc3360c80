"""``offpolicy`` command line: demo, train, lab, inspect, presets, diagnose.

* ``offpolicy demo``      the lab's quick setting: naive vs a correction on the fp32 control and a mismatching
                          engine, six seeds each, with the lab's table and overview picture.
* ``offpolicy train``     a real run from a YAML config plus ``key.sub=value`` overrides (local model paths only).
* ``offpolicy lab``       presets × mismatch sources × seeds, one trainer process per run (resumable), and the
                          lab report (report.html, plots, lab_table.md, lab_stats.json).
* ``offpolicy presets``   the available presets (correction chain + objective).
* ``offpolicy inspect``   a rollout engine against a trainer on one model: full-distribution mismatch, per-layer
                          localisation, self-checked thresholds, report + per-token dump, a CI gate.
* ``offpolicy doctor``    a recipe against a running vLLM server and a TRL / verl config: one pass / fail line per
                          setting that changes μ, with its fix (rewrites nothing).
* ``offpolicy diagnose``  summary table + plots from one or more ``metrics.jsonl`` files; the mismatch report from
                          per-token dumps (``inspect``'s, verl's, TRL's).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import torch
import typer
from rich.console import Console
from rich.markup import escape

from offpolicy.lab.mismatch import SOURCES as LAB_SOURCES  # plain Python: the lab's help text lists them
from offpolicy.lab.settings import SETTINGS as LAB_SETTINGS
from offpolicy.lab.settings import VARIANTS as LAB_VARIANTS

_DEMO = LAB_SETTINGS["quick"]

# Markdown: the docstrings' ``code`` shows as code and their 120-column line breaks are re-flowed to the terminal.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  help=__doc__.split("\n\n")[0])

def _quiet_transformers() -> None:
    """No "Loading weights" / "Writing model shards" bars between our own progress lines."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # transformers is a CLI dependency; without it the run fails later with a clear error
        pass


def _console() -> Console:
    _quiet_transformers()
    # emoji=False: rich would turn ":b:" in user text (task.name=a:b:c) into an emoji; escape() does not stop that
    console = Console(highlight=False, emoji=False)
    if not console.is_terminal:  # logs / CI: rich would wrap the summary table at 80 columns
        console = Console(highlight=False, emoji=False, width=max(console.width, 140))
    return console


def _fail(console: Console, message: str) -> NoReturn:
    # escape: messages quote user text (task.name=a:b:c, run.out_dir=runs/[exp1]) that rich would read as markup
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)  # soft_wrap: one line, even in a log
    raise typer.Exit(code=2)


def _os_error(err: OSError) -> str:
    """One line naming the path an OSError is about (its default str() may not, and a traceback is worse)."""
    where = f" {str(err.filename)!r}" if err.filename is not None else ""
    return f"cannot write or read{where}: {err.strerror or err}"


@contextlib.contextmanager
def _warnings_on(console: Console) -> Iterator[None]:
    """Library warnings (a replaced earlier run, a half-written metrics line, …) as one ``warning:`` line each on
    the console, instead of Python's two-line ``file:line: UserWarning`` format."""

    def show(message, category, filename, lineno, file=None, line=None):  # the warnings.showwarning signature
        console.print(f"[yellow]warning:[/yellow] {escape(str(message))}", soft_wrap=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _make_dir(console: Console, path: Path, option: str) -> None:
    """Create an output folder before any work, failing with one line naming the option and the path."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        _fail(console, f"{option} {str(path)!r} cannot be created: {err.strerror or err}")


@app.command()
def presets() -> None:
    """List the presets: each names a correction chain + an objective."""
    from rich.table import Table

    from offpolicy.train.presets import list_presets

    table = Table(title="offpolicy presets")
    table.add_column("preset")
    table.add_column("objective")
    table.add_column("what it does")
    for name, objective, description in list_presets():
        table.add_row(name, objective, description)
    _console().print(table)


@app.command()
def train(
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML config (defaults if omitted)."),
    overrides: list[str] | None = typer.Argument(None, help="key.sub=value overrides, e.g. run.steps=100"),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint in run.out_dir."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Replace the run that run.out_dir holds (refused without this flag)."),
) -> None:
    """Train with one preset from a YAML config and key=value overrides. Models load from local paths only."""
    from offpolicy.train.config import load_config
    from offpolicy.train.loop import train as run_train

    console = _console()
    try:
        cfg = load_config(config, list(overrides or []))
    except ValueError as err:
        _fail(console, str(err))
    console.print(f"[bold]offpolicy train[/bold] preset={cfg.algorithm.preset} model={escape(cfg.model.path)} "
                  f"steps={cfg.run.steps} → {escape(cfg.run.out_dir)}", soft_wrap=True)
    with _warnings_on(console):
        try:
            result = run_train(cfg, resume=resume, overwrite=overwrite, console=console)
        except ValueError as err:
            _fail(console, str(err))
        except OSError as err:  # a disk that fills up or a folder that turns read-only mid-run
            _fail(console, _os_error(err))
        _print_summary(console, {cfg.algorithm.preset: Path(cfg.run.out_dir) / "metrics.jsonl"}, title="run summary")
    if result.interrupted:
        raise typer.Exit(code=130)


@app.command()
def demo(
    out: Path = typer.Option(Path("offpolicy-demo"), "--out", help="Folder for the runs, the report and the plots."),
    presets_: str | None = typer.Option(None, "--presets", help="Comma-separated presets (default: "
                                   f"{', '.join(_DEMO['presets'])})."),
    mismatch: str | None = typer.Option(None, "--mismatch", help="Comma-separated mismatch sources (default: "
                                           f"{', '.join(m for m in _DEMO['mismatches'] if m != 'none')}); the 'none' "
                                           "control is always added."),
    seeds: int | None = typer.Option(None, "--seeds", help=f"Seeds per preset × mismatch (default {_DEMO['seeds']})."),
    steps: int | None = typer.Option(None, "--steps", help="GRPO steps per run (default "
                                         f"{_DEMO['steps']})."),
    jobs: int | None = typer.Option(None, "--jobs", help="Runs at a time (default: the number of cores)."),
    overrides: list[str] | None = typer.Argument(None, help="Extra key.sub=value trainer overrides for every run."),
) -> None:
    """The lab's quick setting: naive vs a correction, on the fp32 control and a mismatching engine, with seeds.

    The same as ``offpolicy lab --setting quick --out offpolicy-demo``: a second call into the same folder keeps the
    finished runs and renders the report again.
    """
    _lab(out, "quick", presets_, mismatch, seeds, steps, jobs, overrides, report_only=False, keep_checkpoints=False,
         title="offpolicy demo")


@app.command()
def lab(
    setting: str = typer.Option("quick", "--setting", help="Named setting: "
                               f"{', '.join(LAB_SETTINGS)} (quick is the demo)."),
    presets_: str | None = typer.Option(None, "--presets", help="Comma-separated presets or variants "
                                   f"({', '.join(LAB_VARIANTS)}; default: the setting's)."),
    mismatch: str | None = typer.Option(None, "--mismatch", help="Comma-separated rollout-engine mismatch sources "
                                           f"({', '.join(LAB_SOURCES)}) or '+' combinations, e.g. bf16,int8+kv4; "
                                           "the 'none' control (fp32 engine) is always added."),
    seeds: int | None = typer.Option(None, "--seeds", help="Seeds per preset × mismatch (seeds 0 … n−1)."),
    steps: int | None = typer.Option(None, "--steps", help="GRPO steps per run (default: the setting's)."),
    jobs: int | None = typer.Option(None, "--jobs", help="Runs at a time (default: the number of cores)."),
    out: Path = typer.Option(Path("offpolicy-lab"), "--out", help="Sweep folder (runs, summary, report)."),
    report_only: bool = typer.Option(False, "--report-only", help="Only re-render the report of the sweep in --out."),
    keep_checkpoints: bool = typer.Option(False, "--keep-checkpoints",
                                          help="Keep every checkpoint of a finished run (default: the final one)."),
    executor: str = typer.Option("local", "--executor", help="Where the runs start: local (processes on this "
                                 "machine) or ray (Ray actors; see docs/lab/ray.md)."),
    address: str | None = typer.Option(None, "--address", help="--executor ray: an existing Ray cluster (auto, "
                                          "host:6379, ray://host:10001; default: a local cluster for this sweep)."),
    overrides: list[str] | None = typer.Argument(None, help="Extra key.sub=value trainer overrides for every run."),
) -> None:
    """Sweep presets × mismatch sources × seeds (one trainer process per run, resumable) and write the lab report."""
    _lab(out, setting, presets_, mismatch, seeds, steps, jobs, overrides, report_only=report_only,
         keep_checkpoints=keep_checkpoints, title=None, executor=executor, address=address)


def _lab(out: Path, setting: str, presets_: str | None, mismatch: str | None, seeds: int | None,
         steps: int | None, jobs: int | None, overrides: list[str] | None, *, report_only: bool,
         keep_checkpoints: bool, title: str | None, executor: str = "local", address: str | None = None) -> None:
    from offpolicy.lab.report import rich_table, write_report
    from offpolicy.lab.sweep import plan_sweep, run_sweep

    console = _console()
    result = None
    if not report_only:
        try:
            runner = _lab_executor(executor, address)
            plan = plan_sweep(out, setting, presets=presets_, mismatches=mismatch, seeds=seeds, steps=steps,
                              overrides=list(overrides or []))
            t0 = time.perf_counter()
            result = run_sweep(plan, jobs=jobs, console=console, keep_checkpoints=keep_checkpoints, executor=runner)
        except ValueError as err:
            _fail(console, str(err))
        except OSError as err:
            _fail(console, _os_error(err))
        console.print(f"sweep wall time {time.perf_counter() - t0:.0f} s")
        for f in result.failed:
            console.print(f"[red]failed:[/red] {escape(str(out / f.run.dir))}: {escape(f.error)}", soft_wrap=True)
        if not result.done:
            console.print("[yellow]warning:[/yellow] no finished run yet: no report")
            raise typer.Exit(code=130 if result.interrupted else 1)
    with _warnings_on(console):
        try:
            report = write_report(out)
        except ValueError as err:
            _fail(console, str(err))
        except OSError as err:
            _fail(console, _os_error(err))
    console.print(rich_table(report.stats, title=title or f"offpolicy lab {report.stats.get('setting')!s}"))
    console.print(f"[bold]{escape(report.stats['headline'])}[/bold]", soft_wrap=True)
    if report.stats["missing"]:
        console.print(f"[yellow]warning:[/yellow] {len(report.stats['missing'])} planned runs missing "
                      "(failed or not run yet); the table uses the finished runs")
    console.print(f"report: {escape(str(report.html))}", soft_wrap=True)
    console.print(f"overview: {escape(str(out / 'plots' / 'overview.png'))}   plots: {escape(str(out / 'plots'))}/ "
                  f"({', '.join(p.name for p in report.plots)})", soft_wrap=True)
    console.print(f"table: {escape(str(report.table))}   numbers: {escape(str(report.stats_path))}", soft_wrap=True)
    if result is not None and result.interrupted:
        raise typer.Exit(code=130)
    if result is not None and result.failed:
        raise typer.Exit(code=1)


def _lab_executor(executor: str, address: str | None):  # -> RayExecutor | None
    """``--executor`` / ``--address`` → what ``run_sweep`` takes (None: local processes)."""
    if executor not in ("local", "ray"):
        raise ValueError(f"--executor must be local or ray, got {executor!r}")
    if executor == "local":
        if address is not None:
            raise ValueError("--address names a Ray cluster: use it with --executor ray")
        return None
    from offpolicy.lab.ray_exec import RayExecutor

    return RayExecutor(address)


@app.command()
def diagnose(
    metrics: list[Path] = typer.Argument(..., help="metrics.jsonl file(s) or run folders; or per-token dumps "
                                         "(offpolicy inspect's tokens.jsonl, verl's or TRL's tensors as .pt / "
                                         ".safetensors / .jsonl)."),
    out: Path | None = typer.Option(None, "--out", help="Folder for the PNG plots (default: next to the first file)."),
    fail_above: str | None = typer.Option(None, "--fail-above", help="Dumps only: CI gate, e.g. kl=1e-3,max_kl=0.05."),
) -> None:
    """Summary table and plots (reward, train–infer KL, PPL gap, masked fraction) from metrics.jsonl files; the
    mismatch report (as offpolicy inspect's, without a model) from per-token dumps."""
    console = _console()
    from offpolicy.diagnose.dumps import is_dump
    from offpolicy.diagnose.report import load_runs

    if any(is_dump(p) for p in metrics):
        _diagnose_dumps(console, list(metrics), out, fail_above)
        return
    if fail_above:
        _fail(console, "--fail-above applies to per-token dumps, not to metrics.jsonl files")

    with _warnings_on(console):  # load_runs warns about half-written last lines and runs with no steps
        try:
            runs = load_runs(list(metrics))
        except ValueError as err:
            _fail(console, str(err))
    if not runs:  # every file was empty: a table of dashes and blank plots would only hide that
        console.print("[yellow]warning:[/yellow] no logged steps in the given metrics file(s): no summary, no plots")
        return
    first = metrics[0] if metrics[0].is_dir() else metrics[0].parent
    plots = out or first / "plots"
    _make_dir(console, plots, "--out")
    try:
        _print_summary(console, None, runs=runs, title="offpolicy diagnose", plots=plots)
    except OSError as err:
        _fail(console, _os_error(err))


@app.command()
def doctor(
    server: str = typer.Option(..., "--server", help="The running vLLM server's base URL, e.g. http://127.0.0.1:8000."),
    trl_config: Path | None = typer.Option(None, "--trl-config", help="TRL: GRPOConfig fields as YAML/JSON (plus "
                                           "model_name_or_path and an offpolicy: block of the trainer's keywords)."),
    verl_config: Path | None = typer.Option(None, "--verl-config", help="verl: the trainer config YAML (nested or "
                                            "dotted keys)."),
    vllm_args: str | None = typer.Option(None, "--vllm-args", help="The server's command line, for what it does not "
                                         "report (outside vLLM's dev mode), e.g. '--logprobs-mode processed_logprobs'."),
) -> None:
    """Check a recipe against a running vLLM server before a run: log-probs mode, sampling parameters, served and
    head dtype, tied head, prefix caching, async scheduling, sync check, versions. One pass / FAIL line each with
    its fix; exit code 1 on any failure. Rewrites nothing."""
    console = _console()
    from offpolicy.diagnose.doctor import load_config, read_server, run_checks
    from offpolicy.rollout.http import ServerError

    if (trl_config is None) == (verl_config is None):
        _fail(console, "give one of --trl-config or --verl-config")
    framework, path = ("trl", trl_config) if trl_config is not None else ("verl", verl_config)
    try:
        cfg = load_config(path)  # type: ignore[arg-type]  # one of the two is set (checked above)
        facts = read_server(server, vllm_args=vllm_args)
        checks = run_checks(facts, cfg, framework)
    except (ValueError, ServerError) as err:
        _fail(console, str(err))
    console.print(f"[bold]doctor[/bold] {escape(facts.url)} against {framework} config {escape(str(path))}",
                  soft_wrap=True)
    for check in checks:
        mark = "[green]pass[/green]" if check.ok else "[red]FAIL[/red]"
        console.print(f"{mark} {escape(check.name)}: {escape(check.detail)}", soft_wrap=True)
        if not check.ok:
            console.print(f"     fix: {escape(check.fix)}", soft_wrap=True)
    failed = sum(not c.ok for c in checks)
    if failed:
        console.print(f"[red]{failed} of {len(checks)} checks failed[/red]")
        raise typer.Exit(code=1)
    console.print(f"[green]all {len(checks)} checks passed[/green]")


@app.command(name="inspect")
def inspect_command(
    model: str = typer.Option("tiny", "--model", help="tiny or lab (embedded, warm-started), tiny-random, or a local "
                              "model directory (nothing is downloaded)."),
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

    console = _console()
    try:  # every argument checked before any work
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
    except ValueError as err:
        _fail(console, str(err))
    if check_sync is not None:
        _check_sync(console, model, rollouts, task=task, prompts=prompts, seed=seed, tolerance=check_sync,
                    max_new_tokens=max_new_tokens)
        return
    _make_dir(console, out, "--out")
    threads_before = torch.get_num_threads()
    if threads is None and model in ("tiny", "lab", "tiny-random"):
        threads = 1  # as the demo: on a shared 2-core machine a second thread mostly spins (measured 2-5x slower)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with _warnings_on(console):
            summaries = _inspect_runs(console, model, out, pairs, sampling, task=task, prompts=prompts, seed=seed,
                                      ignore_eos=ignore_eos, topk=topk, layers=layers, layer_threshold=layer_threshold,
                                      rollout_view=rollout_view, budget=memory_budget_mb << 20, sampler=sampler)
    except ValueError as err:
        _fail(console, str(err))
    except OSError as err:
        _fail(console, _os_error(err))
    finally:
        torch.set_num_threads(threads_before)
    _gate(console, summaries, bounds)


def _check_sync(console: Console, model_path: str, rollouts, *, task: str, prompts: int, seed: int,  # noqa: ANN001
                tolerance: float, max_new_tokens: int) -> None:
    """``inspect --check-sync``: does each engine hold the model's weights? A probe (8 of the task's prompts, answered
    by the engine) scored by the engine and by the trainer; one line per engine, exit 1 on the first that does not."""
    from offpolicy.inspect.compare import _rollout_engine
    from offpolicy.inspect.run import load_model, task_prompts
    from offpolicy.rollout.sampling import SamplingConfig
    from offpolicy.rollout.sync_check import SyncCheck, SyncProbe

    try:
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
    except ValueError as err:
        _fail(console, str(err))


def _inspect_runs(console: Console, model_path: str, out: Path, pairs, sampling, *, task: str, prompts: int,  # noqa: ANN001
                  seed: int, ignore_eos: bool, topk: int, layers: bool, layer_threshold: float, rollout_view: str,
                  budget: int, sampler=None) -> list[dict]:  # noqa: ANN001
    from offpolicy.inspect.dump import write_dump
    from offpolicy.inspect.report import markdown_table, write_report
    from offpolicy.inspect.run import inspect_engines, load_model, task_prompts

    t0 = time.perf_counter()
    local = model_path if Path(model_path).is_dir() else None
    if model_path in ("tiny", "lab"):
        from offpolicy.models import get_recipe, model_dir
        from offpolicy.models import model_path as embedded_path

        if not model_dir(get_recipe(model_path)).is_dir():
            console.print(f"[bold]warm start[/bold] of the embedded {model_path} model (cached after the first run) …")
        local = str(embedded_path(model_path))  # its directory, for an engine that loads it itself (vLLM)
    model, tokenizer = load_model(model_path)
    prompt_ids = task_prompts(tokenizer, task, prompts, seed=seed)
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
        summary = write_report(measured, folder)
        write_dump(measured, folder / "tokens.jsonl")
        _print_inspection(console, summary, folder)
        summaries.append(summary)
    if len(pairs) > 1:
        (out / "table.md").write_text(markdown_table(summaries))
        console.print(f"mismatch table: {escape(str(out / 'table.md'))}")
    console.print(f"total wall time {time.perf_counter() - t0:.1f} s")
    return summaries


def _print_inspection(console: Console, summary: dict, folder: Path, *, dump: bool = True) -> None:
    from rich.table import Table

    def g(x) -> str:  # noqa: ANN001
        return "–" if x is None else f"{x:.4g}" if isinstance(x, float) else escape(str(x))

    table = Table(title=f"mismatch ({escape(str(summary.get('kl_source')))} KL)")
    for col in ("mean KL", "max KL", "mean TV", "tail/head", "ESS", "enters at", "most added by"):
        table.add_column(col, justify="right")
    table.add_row(g(summary["kl_mean"]), g(summary["kl_max"]), g(summary.get("tv_mean")),
                  g(summary.get("tail_head_ratio")), g(summary.get("ess")), g(summary.get("first_divergent_layer")),
                  g(summary.get("largest_share_layer")))
    console.print(table)
    rec = Table(title="recommended thresholds (re-applied: kept)")
    for col in ("correction", "threshold", "kept", "target"):
        rec.add_column(col)
    for name, r in summary["recommended"].items():
        th = r["threshold"]
        th = "[" + ", ".join(f"{v:.4g}" for v in th) + "]" if isinstance(th, list) else f"{th:.4g}"
        rec.add_row(name, th, f"{r['kept_fraction']:.1%}", escape(r["target"]))
    console.print(rec)
    extra = ", tokens.jsonl" if dump else ""
    console.print(f"report: {escape(str(folder / 'report.html'))} (+ report.json, PNGs{extra})")


def _gate(console: Console, summaries: list[dict], bounds: dict | None) -> None:
    """--fail-above: one line per metric over its bound, exit code 1; nothing within bounds."""
    from offpolicy.inspect.gate import check_bounds

    if not bounds:
        return
    failures = []
    for summary in summaries:
        try:
            lines = check_bounds(summary, bounds)
        except ValueError as err:
            _fail(console, str(err))
        name = (summary.get("meta") or {}).get("rollout", {}).get("name")
        failures += [f"{name}: {line}" if len(summaries) > 1 else line for line in lines]
    for line in failures:
        console.print(f"[red]FAIL[/red] {escape(line)}", soft_wrap=True)
    if failures:
        raise typer.Exit(code=1)
    console.print(f"[green]ok[/green] within bounds: {', '.join(f'{k} ≤ {v:g}' for k, v in bounds.items())}")


def _diagnose_dumps(console: Console, paths: list[Path], out: Path | None, fail_above: str | None) -> None:
    """``offpolicy diagnose`` on per-token dumps (this project's, verl's, TRL's): the inspection report, no model."""
    from offpolicy.diagnose.dumps import measurements_from_dumps
    from offpolicy.inspect.gate import parse_bounds
    from offpolicy.inspect.report import write_report

    try:
        bounds = parse_bounds(fail_above) if fail_above else None
        with _warnings_on(console):
            measured = measurements_from_dumps(paths)
    except ValueError as err:
        _fail(console, str(err))
    folder = out or paths[0].parent / f"{paths[0].stem}-report"
    _make_dir(console, folder, "--out")
    try:
        summary = write_report(measured, folder)
    except OSError as err:
        _fail(console, _os_error(err))
    console.print(f"[bold]diagnose[/bold] {len(paths)} dump(s) ({', '.join(sorted(set(measured.meta['formats'])))}): "
                  f"{summary['positions']} tokens in {summary['sequences']} sequences", soft_wrap=True)
    _print_inspection(console, summary, folder, dump=False)
    _gate(console, [summary], bounds)


def _print_summary(console: Console, paths: dict[str, Path] | None, *, runs=None, title: str,  # noqa: ANN001
                   plots: Path | None = None) -> None:
    from offpolicy.diagnose.report import plot_runs, read_metrics, summary_rows, summary_table

    if runs is None:
        try:
            runs = {name: read_metrics(p) for name, p in (paths or {}).items() if p.is_file()}
        except ValueError as err:  # a damaged metrics file: the run itself finished, so say why there is no table
            console.print(f"[yellow]warning:[/yellow] no summary: {escape(str(err))}")
            return
        runs = {name: rows for name, rows in runs.items() if rows}
    if not runs:
        return
    rows = summary_rows(runs)
    console.print(summary_table(rows, title=title))
    if plots is not None:
        written = plot_runs(runs, plots)
        console.print(f"plots: {escape(str(plots))}/ ({', '.join(p.name for p in written)})")


def main() -> None:
    """Entry point of the ``offpolicy`` console script."""
    app()


if __name__ == "__main__":
    main()
