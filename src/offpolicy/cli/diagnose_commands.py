"""``offpolicy diagnose`` (metrics files or per-token dumps) and ``offpolicy doctor`` (a recipe against a running
vLLM server)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from offpolicy.cli.base import fail, failing, make_console, make_dir, warnings_on
from offpolicy.cli.output import check_gate, print_inspection, print_summary


def diagnose(
    metrics: list[Path] = typer.Argument(..., help="metrics.jsonl file(s) or run folders; or per-token dumps "
                                         "(offpolicy inspect's tokens.jsonl, verl's or TRL's tensors as .pt / "
                                         ".safetensors / .jsonl)."),
    out: Path | None = typer.Option(None, "--out", help="Folder for the PNG plots (default: next to the first file)."),
    fail_above: str | None = typer.Option(None, "--fail-above", help="Dumps only: CI gate, e.g. kl=1e-3,max_kl=0.05."),
) -> None:
    """Summary table and plots (reward, train–infer KL, PPL gap, masked fraction) from metrics.jsonl files; the
    mismatch report (as offpolicy inspect's, without a model) from per-token dumps."""
    console = make_console()
    from offpolicy.diagnose.dumps import is_dump
    from offpolicy.diagnose.report import load_runs

    if any(is_dump(p) for p in metrics):
        _diagnose_dumps(console, list(metrics), out, fail_above)
        return
    if fail_above:
        fail(console, "--fail-above applies to per-token dumps, not to metrics.jsonl files")

    with warnings_on(console), failing(console):  # load_runs warns about half-written last lines, runs with no steps
        runs = load_runs(list(metrics))
    if not runs:  # every file was empty: a table of dashes and blank plots would only hide that
        console.print("[yellow]warning:[/yellow] no logged steps in the given metrics file(s): no summary, no plots")
        return
    first = metrics[0] if metrics[0].is_dir() else metrics[0].parent
    plots = out or first / "plots"
    make_dir(console, plots, "--out")
    with failing(console):
        print_summary(console, None, runs=runs, title="offpolicy diagnose", plots=plots)


def doctor(
    server: str | None = typer.Option(None, "--server", help="The running vLLM server's base URL, e.g. "
                                      "http://127.0.0.1:8000."),
    trl_config: Path | None = typer.Option(None, "--trl-config", help="TRL: GRPOConfig fields as YAML/JSON (plus "
                                           "model_name_or_path and an offpolicy: block of the trainer's keywords)."),
    verl_config: Path | None = typer.Option(None, "--verl-config", help="verl: the trainer config YAML (nested or "
                                            "dotted keys)."),
    vllm_args: str | None = typer.Option(None, "--vllm-args", help="The server's command line, for what it does not "
                                         "report (outside vLLM's dev mode), e.g. '--logprobs-mode processed_logprobs'."),
    recipe: Path | None = typer.Option(None, "--recipe", help="A recipe file (offpolicy.Recipe, YAML/JSON): validate "
                                       "it, list what it needs and which hosts accept it (no server needed)."),
) -> None:
    """Check a recipe against a running vLLM server before a run: log-probs mode, sampling parameters, served and
    head dtype, tied head, prefix caching, async scheduling, sync check, versions. One pass / FAIL line each with
    its fix; exit code 1 on any failure. Rewrites nothing."""
    console = make_console()
    from offpolicy.diagnose.doctor import load_config, read_server, run_checks
    from offpolicy.diagnose.recipe_check import recipe_checks
    if recipe is not None:
        with failing(console):
            lines = recipe_checks(recipe)
        console.print(f"[bold]doctor[/bold] recipe {escape(str(recipe))}", soft_wrap=True)
        for line in lines:
            console.print(escape(line), soft_wrap=True)
        if server is None:
            return
    if server is None:
        fail(console, "give --server (a running vLLM server) or --recipe FILE")
    if (trl_config is None) == (verl_config is None):
        fail(console, "give one of --trl-config or --verl-config")
    framework, path = ("trl", trl_config) if trl_config is not None else ("verl", verl_config)
    with failing(console):  # a ServerError is a ValueError
        cfg = load_config(path)  # type: ignore[arg-type]  # one of the two is set (checked above)
        facts = read_server(server, vllm_args=vllm_args)
        checks = run_checks(facts, cfg, framework)
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



def _diagnose_dumps(console: Console, paths: list[Path], out: Path | None, fail_above: str | None) -> None:
    """``offpolicy diagnose`` on per-token dumps (this project's, verl's, TRL's): the inspection report, no model."""
    from offpolicy.diagnose.dumps import measurements_from_dumps
    from offpolicy.inspect.gate import parse_bounds
    from offpolicy.inspect.report import write_report

    with failing(console), warnings_on(console):
        bounds = parse_bounds(fail_above) if fail_above else None
        measured = measurements_from_dumps(paths)
    folder = out or paths[0].parent / f"{paths[0].stem}-report"
    make_dir(console, folder, "--out")
    with failing(console):
        summary = write_report(measured, folder)
    console.print(f"[bold]diagnose[/bold] {len(paths)} dump(s) ({', '.join(sorted(set(measured.meta['formats'])))}): "
                  f"{summary['positions']} tokens in {summary['sequences']} sequences", soft_wrap=True)
    print_inspection(console, summary, folder, dump=False)
    check_gate(console, [summary], bounds)
