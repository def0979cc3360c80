"""``python -m offpolicy.cli``: the ``offpolicy`` console script."""

from offpolicy.cli import main

main()
