"""YAML with numbers as people write them: the one loader for every YAML a user hands offpolicy.

PyYAML implements YAML 1.1, whose float needs a dot and a signed exponent: ``1e-4``, ``2e0``, ``5E-1``, ``-3e-2``,
``1.0e4``, ``-.5`` and Python's own ``repr(1e-05)`` all load as *strings* there, and a threshold written that way was
refused as "not a real number". :class:`NumberLoader` is PyYAML's ``SafeLoader`` plus one implicit resolver for the
floats YAML 1.2's core schema has and YAML 1.1 lacks, so these load as floats, by PyYAML's own float constructor.

What is a number (everything else stays a string, and a setting that wants a number refuses it naming the key):

* a float of YAML 1.2's core schema — ``[-+]? ( .D+ | D+ ( .D* )? ) ( [eE] [-+]? D+ )?``: ``1e-4``, ``2e0``, ``5E-1``,
  ``-3e-2``, ``.5``, ``-.5``, ``5.``, ``1.0e4``, ``1e+16``, and whatever ``repr(x)`` or ``f"{x:e}"`` print for a
  finite float ``x``;
* what PyYAML already reads as a number, unchanged: integers (``3``, ``-7``, ``0x1F``), ``_`` between digits
  (``1_000`` is 1000, ``1_000.5`` and ``1_000e-3`` too), ``.inf``, ``-.inf``, ``.nan``. (YAML 1.1's base-60 ``1:30``
  is also still PyYAML's 90: quote such text.)
* not numbers: ``inf``, ``nan``, ``1e``, ``e5``, ``1.2.3``, ``0x1p-3``.

>>> load_yaml("{lr: 1e-4, upper: 2e0, eps: -.5, n: 1_000}")
{'lr': 0.0001, 'upper': 2.0, 'eps': -0.5, 'n': 1000}
>>> load_yaml("[inf, 1e]")
['inf', '1e']
"""

from __future__ import annotations

import re
from typing import Any

import yaml

# YAML 1.2's floats that YAML 1.1's resolver misses: an exponent with or without a dot or a sign, and a leading dot
# after a sign; PyYAML's float resolver (tried first) keeps the forms it knows, with their meaning.
_MISSING_FLOATS = re.compile(r"""^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+
                                 |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?)$""", re.VERBOSE)


class NumberLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose floats follow YAML 1.2 (see the module docstring); ``SafeLoader`` itself unchanged."""


NumberLoader.add_implicit_resolver("tag:yaml.org,2002:float", _MISSING_FLOATS, list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with :class:`NumberLoader`: the same objects, numbers as YAML 1.2 writes them.

    Raises ``yaml.YAMLError`` for text that is not YAML (the caller names the file or setting).
    """
    return yaml.load(text, Loader=NumberLoader)  # noqa: S506 - a SafeLoader subclass: no arbitrary objects


def yaml_problem(err: yaml.YAMLError) -> str:
    """The one-line gist of a YAML error (its ``problem`` and position, without the multi-line excerpt)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


__all__ = ["NumberLoader", "load_yaml", "yaml_problem"]
