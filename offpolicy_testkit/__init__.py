"""Harnesses shared by the test suite, the benchmarks and the scripts (not part of the offpolicy distribution).

Not installed, not in the wheel: pytest puts the repository root on ``sys.path`` (``pythonpath`` in pyproject.toml),
and a benchmark or script that uses it runs from the root with the root on the path
(``PYTHONPATH=. python benchmarks/trl_sync_check_cost.py``). Not ``python -m scripts.…`` / ``tests.…``: verl installs
top-level packages named ``scripts`` and ``tests`` that shadow the repository's folders.
"""
