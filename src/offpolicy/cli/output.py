"""What the commands print: the summary table and plots of training runs, an inspection's tables, and the
``--fail-above`` gate's verdict."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from offpolicy.cli.base import failing


def print_inspection(console: Console, summary: dict, folder: Path, *, dump: bool = True) -> None:
    """An inspection's mismatch numbers and recommended thresholds (a :func:`offpolicy.inspect.summary.summarize`
    result) as two tables, and where its report went."""
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
    routing = summary.get("routing")
    if routing:
        layers = ", ".join(f"{r:.2%}" for r in routing["flip_rate_per_layer"])
        console.print(f"routing flips (MoE): {routing['flip_rate']:.2%} of routed token slots, per layer [{layers}]; "
                      f"{routing['flipped_tokens']} response tokens flipped, mean KL(π‖μ) flipped "
                      f"{g(routing['kl_reverse_flipped_mean'])} vs unflipped {g(routing['kl_reverse_unflipped_mean'])}"
                      f" ({g(routing['kl_reverse_ratio'])}×)", soft_wrap=True)
    beside = summary.get("beside")
    if beside:
        console.print(f"beside {escape(str(beside['model']))} (same engines and prompts): mean KL "
                      f"{g(summary.get('kl_mean'))} vs {g(beside.get('kl_mean'))} ({g(beside.get('kl_mean_ratio'))}×), "
                      f"k3 {g(summary.get('k3_kl'))} vs {g(beside.get('k3_kl'))} ({g(beside.get('k3_kl_ratio'))}×)",
                      soft_wrap=True)
    extra = ", tokens.jsonl" if dump else ""
    console.print(f"report: {escape(str(folder / 'report.html'))} (+ report.json, PNGs{extra})")


def check_gate(console: Console, summaries: list[dict], bounds: dict | None) -> None:
    """--fail-above: one line per metric over its bound, exit code 1; nothing within bounds."""
    from offpolicy.inspect.gate import check_bounds

    if not bounds:
        return
    failures = []
    for summary in summaries:
        with failing(console):
            lines = check_bounds(summary, bounds)
        name = (summary.get("meta") or {}).get("rollout", {}).get("name")
        failures += [f"{name}: {line}" if len(summaries) > 1 else line for line in lines]
    for line in failures:
        console.print(f"[red]FAIL[/red] {escape(line)}", soft_wrap=True)
    if failures:
        raise typer.Exit(code=1)
    console.print(f"[green]ok[/green] within bounds: {', '.join(f'{k} ≤ {v:g}' for k, v in bounds.items())}")



def print_summary(console: Console, paths: dict[str, Path] | None, *, runs=None, title: str,  # noqa: ANN001
                   plots: Path | None = None) -> None:
    """The summary table of training runs (``{name: metrics.jsonl}``, or their rows as ``runs``), and their plots in
    ``plots`` when given; a damaged metrics file is a warning line, not an error (the run itself finished)."""
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
