"""Doctest collection of the package (pyproject.toml: ``--doctest-modules`` over ``src/offpolicy``) — here, at the
repository root, so that no conftest ships in the wheel.

The verl plug-in's modules import verl, and registering is the plug-in's import-time effect: pytest collects only the
verl-free ones (the plug-in is tested in tests/integrations/)."""

import importlib.util

VERL = "src/offpolicy/integrations/verl/"

collect_ignore = [VERL + "plugin.py"]
if importlib.util.find_spec("verl") is None:
    collect_ignore += [VERL + "engine.py", VERL + "agent_loop.py"]
