"""`offpolicy --help` renders its docstrings as text: no reST markup, no line break inside a sentence."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from offpolicy.cli import app

runner = CliRunner()
COMMANDS = ["", "demo", "train", "lab", "inspect", "presets", "diagnose", "doctor"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_no_rest_markup(command):
    res = runner.invoke(app, [*command.split(), "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert res.exit_code == 0, res.output
    assert "``" not in res.output and ":func:" not in res.output


def test_help_paragraphs_are_reflowed():
    # The demo's docstring wraps its second paragraph at 120 characters in the source; the help must join the
    # source's line break ("keeps the" / "finished runs") and wrap at the terminal's width instead.
    res = runner.invoke(app, ["demo", "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert res.exit_code == 0, res.output
    lines = [" ".join(line.split()) for line in res.output.splitlines()]
    assert any("offpolicy lab --setting quick --out offpolicy-demo: a second call into the same folder keeps the "
               "finished runs and renders the report again." in line for line in lines), res.output
    top = runner.invoke(app, ["--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert "offpolicy command line: demo, train, lab, inspect, presets, diagnose." in top.output
