"""MkDocs hook for the API reference: ``::: package.*`` stands for every module of the package not named on the page.

An API page names the modules it wants first, in reading order, and ends with ``::: offpolicy.corrections.*``; the
hook replaces that line by one ``::: module`` directive per remaining module of the package (subpackages included,
recursively; private modules and ``conftest`` left out), so a module added to the package appears in the reference
without editing the page.

>>> lines = expand("::: offpolicy.corrections.base\\n::: offpolicy.corrections.*", Path("src")).splitlines()
>>> lines[0], "::: offpolicy.corrections.base" in lines[1:], "::: offpolicy.corrections.importance" in lines
('::: offpolicy.corrections.base', False, True)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# A note for readers of the Markdown on GitHub, which shows each ``::: module`` line as text: the site drops it.
_GITHUB_ONLY = re.compile(r"^<!-- github-only -->\n.*?^<!-- /github-only -->\n", re.M | re.S)
_WILDCARD = re.compile(r"^::: ([\w.]+)\.\*[ \t]*$", re.M)
_NAMED = re.compile(r"^::: ([\w.]+)[ \t]*$", re.M)
SRC = Path(__file__).resolve().parents[2] / "src"


def modules(package: str, src: Path = SRC) -> list[str]:
    """Every public module of ``package`` under ``src``, depth first: a subpackage, then its modules."""
    folder = src.joinpath(*package.split("."))
    if not (folder / "__init__.py").is_file():
        raise ValueError(f"::: {package}.* names no package under {src}")
    found: list[str] = []
    for entry in sorted(folder.iterdir()):
        name = entry.stem
        if name.startswith("_") or name == "conftest":
            continue
        if entry.is_dir() and (entry / "__init__.py").is_file():
            found += [f"{package}.{name}", *modules(f"{package}.{name}", src)]
        elif entry.suffix == ".py":
            found.append(f"{package}.{name}")
    return found


def expand(markdown: str, src: Path = SRC) -> str:
    """Replace each ``::: package.*`` line by the package's modules that the page does not name itself."""
    named = set(_NAMED.findall(markdown))

    def repl(match: re.Match[str]) -> str:
        rest = [m for m in modules(match.group(1), src) if m not in named]
        named.update(rest)
        return "\n\n".join(f"::: {m}" for m in rest)

    return _WILDCARD.sub(repl, markdown)


def drop_github_only(markdown: str) -> str:
    """The page without its GitHub-only notes (between ``<!-- github-only -->`` and ``<!-- /github-only -->``).

    >>> drop_github_only("a\\n<!-- github-only -->\\nnote\\n<!-- /github-only -->\\nb\\n")
    'a\\nb\\n'
    """
    return _GITHUB_ONLY.sub("", markdown)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """MkDocs event: drop the GitHub-only notes and expand the wildcards before mkdocstrings sees the page."""
    return expand(drop_github_only(markdown))
