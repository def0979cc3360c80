"""``offpolicy demo`` and ``offpolicy lab``: sweeps of presets × mismatch sources × seeds and their report."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.markup import escape

from offpolicy.cli.base import failing, make_console, warnings_on
from offpolicy.lab.mismatch import SOURCES as LAB_SOURCES  # plain Python: the lab's help text lists them
from offpolicy.lab.settings import SETTINGS as LAB_SETTINGS
from offpolicy.lab.settings import VARIANTS as LAB_VARIANTS

_DEMO = LAB_SETTINGS["quick"]
_DEMO_MISMATCHES = ", ".join(m for m in _DEMO["mismatches"] if m != "none")  # the control is always added


def demo(
    out: Path = typer.Option(Path("offpolicy-demo"), "--out", help="Folder for the runs, the report and the plots."),
    presets_: str | None = typer.Option(None, "--presets", help="Comma-separated presets (default: "
                                   f"{', '.join(_DEMO['presets'])})."),
    mismatch: str | None = typer.Option(None, "--mismatch", help="Comma-separated mismatch sources (default: "
                                           f"{_DEMO_MISMATCHES}); the 'none' "
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
    from offpolicy.lab.plan import plan_sweep
    from offpolicy.lab.report import write_report
    from offpolicy.lab.sweep import run_sweep
    from offpolicy.lab.tables import rich_table

    console = make_console()
    result = None
    if not report_only:
        with failing(console):
            runner = _lab_executor(executor, address)
            plan = plan_sweep(out, setting, presets=presets_, mismatches=mismatch, seeds=seeds, steps=steps,
                              overrides=list(overrides or []))
            t0 = time.perf_counter()
            result = run_sweep(plan, jobs=jobs, console=console, keep_checkpoints=keep_checkpoints, executor=runner)
        console.print(f"sweep wall time {time.perf_counter() - t0:.0f} s")
        for f in result.failed:
            console.print(f"[red]failed:[/red] {escape(str(out / f.run.dir))}: {escape(f.error)}", soft_wrap=True)
        if not result.done:
            console.print("[yellow]warning:[/yellow] no finished run yet: no report")
            raise typer.Exit(code=130 if result.interrupted else 1)
    with warnings_on(console), failing(console):
        report = write_report(out)
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
