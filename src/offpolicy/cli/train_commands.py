"""``offpolicy presets`` and ``offpolicy train``: the presets, and one run from a YAML config plus overrides."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from offpolicy.cli.base import fail, failing, make_console, warnings_on
from offpolicy.cli.output import print_summary


def presets(
    name: str | None = typer.Argument(None, help="A preset: print its recipe as YAML (a file to start from)."),
    write: Path | None = typer.Option(None, "--write", help="With NAME: write the recipe to this file too."),
) -> None:
    """List the presets: each names a correction chain + an objective, and is a named recipe (offpolicy.recipe)."""
    from rich.table import Table

    from offpolicy.recipe.named import named_recipe
    from offpolicy.train.presets import list_presets

    console = make_console()
    if name is not None:
        with failing(console):
            text = named_recipe(name).dump(write)
        console.print(escape(text.rstrip()), soft_wrap=True)
        return
    if write is not None:
        fail(console, "--write needs a preset NAME (offpolicy presets NAME --write FILE)")
    table = Table(title="offpolicy presets")
    table.add_column("preset")
    table.add_column("objective")
    table.add_column("transforms")
    table.add_column("what it does")
    for preset, objective, description in list_presets():
        table.add_row(preset, objective, ", ".join(named_recipe(preset).transforms) or "-", description)
    console.print(table)


def train(
    config: Path | None = typer.Option(None, "--config", "-c", help="YAML config (defaults if omitted)."),
    overrides: list[str] | None = typer.Argument(None, help="key.sub=value overrides, e.g. run.steps=100"),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint in run.out_dir."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Replace the run that run.out_dir holds (refused without this flag)."),
    allow_changed: list[str] | None = typer.Option(
        None, "--allow-changed", metavar="KEY",
        help="With --resume: let this recipe setting (e.g. algorithm.is_upper, or a section: algorithm) differ from "
             "the checkpoint's; recorded in run.out_dir/offpolicy_settings_changes.jsonl. Repeatable."),
) -> None:
    """Train with one preset from a YAML config and key=value overrides. Models load from local paths only.

    --resume refuses a checkpoint whose recipe settings (algorithm.*, alp.*, the sampling recipe) differ from the
    config's, naming each; --allow-changed KEY resumes with the new value and records the change."""
    from offpolicy.train.config import load_config
    from offpolicy.train.loop import train as run_train

    console = make_console()
    with failing(console):
        cfg = load_config(config, list(overrides or []))
    console.print(f"[bold]offpolicy train[/bold] preset={cfg.algorithm.preset} model={escape(cfg.model.path)} "
                  f"steps={cfg.run.steps} → {escape(cfg.run.out_dir)}", soft_wrap=True)
    with warnings_on(console):
        with failing(console):  # an OSError too: a disk that fills up or a folder that turns read-only mid-run
            result = run_train(cfg, resume=resume, overwrite=overwrite, console=console,
                               allow_changed=tuple(allow_changed or ()))
        print_summary(console, {cfg.algorithm.preset: Path(cfg.run.out_dir) / "metrics.jsonl"}, title="run summary")
    if result.interrupted:
        raise typer.Exit(code=130)
