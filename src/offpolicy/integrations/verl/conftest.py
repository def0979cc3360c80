"""Doctest collection of the verl plug-in: its modules import verl (and registering is the plug-in's import-time
effect), so pytest collects only the verl-free modules here; the plug-in is tested in tests/integrations/."""

import importlib.util

collect_ignore = ["plugin.py"]
if importlib.util.find_spec("verl") is None:
    collect_ignore += ["engine.py", "agent_loop.py", "platform_cpu.py"]
