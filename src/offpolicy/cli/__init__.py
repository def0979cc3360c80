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

The commands live one group per module (:mod:`~offpolicy.cli.train_commands`, :mod:`~offpolicy.cli.lab_commands`,
:mod:`~offpolicy.cli.inspect_commands`, :mod:`~offpolicy.cli.diagnose_commands`) and are registered here, on the one
typer application of :mod:`~offpolicy.cli.base`, in the order ``--help`` lists them. ``offpolicy.cli:main`` is the
console script; ``python -m offpolicy.cli`` runs the same.
"""

from __future__ import annotations

from offpolicy.cli.base import app
from offpolicy.cli.diagnose_commands import diagnose, doctor
from offpolicy.cli.inspect_commands import inspect_command
from offpolicy.cli.lab_commands import demo, lab
from offpolicy.cli.train_commands import presets, train

# registered here, in the order `offpolicy --help` lists them
for _command in (presets, train, demo, lab, diagnose, doctor):
    app.command()(_command)
app.command(name="inspect")(inspect_command)

__all__ = ["app", "main"]


def main() -> None:
    """Entry point of the ``offpolicy`` console script."""
    app()
