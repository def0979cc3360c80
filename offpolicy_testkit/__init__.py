"""Harnesses shared by the test suite, the benchmarks and the scripts (not part of the offpolicy distribution).

Importable from the repository root: pytest puts the root on ``sys.path`` (``pythonpath`` in pyproject.toml), and the
benchmarks and scripts that use it run as modules from the root (``python -m benchmarks.trl_sync_check_cost``).
"""
