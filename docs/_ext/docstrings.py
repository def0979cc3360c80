"""Griffe extension for the docs build: the package's reST-flavoured docstrings rendered as Markdown.

The docstrings are written for ``help()`` and doctest: ``>>>`` examples, ``::`` literal blocks and Sphinx roles
(``:func:`name```). Markdown would run the examples and literal blocks together into paragraphs and print the roles
as text, so each is rewritten before mkdocstrings renders it — the source stays as it is:

* a ``>>>`` example (up to the next blank line) becomes a fenced ``pycon`` block;
* a paragraph ending in ``::`` followed by an indented block becomes the paragraph ending in ``:`` and a fenced block;
* a reST simple table (``====  ====`` borders) becomes a fenced block, as it reads in the source;
* ``:func:`x```, ``:class:`x```, ``:meth:`x```, … become ``x`` in code.

>>> print(to_markdown("Names, see :func:`chain`::\\n\\n    tis   truncate"))
Names, see `chain`:
<BLANKLINE>
```text
tis   truncate
```
<BLANKLINE>
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_TABLE_BORDER = re.compile(r"^\s*=+(\s+=+)+\s*$")
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|obj|exc|const):`~?([^`]+)`")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def to_markdown(text: str) -> str:
    """Rewrite doctest examples, ``::`` literal blocks and Sphinx roles of one docstring as Markdown."""
    lines = _ROLE.sub(r"`\1`", text).split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith(">>>"):
            pad = " " * _indent(line)
            out.append(f"{pad}```pycon")
            while i < len(lines) and lines[i].strip():
                out.append(pad + lines[i][len(pad):] if lines[i].startswith(pad) else lines[i])
                i += 1
            out.append(f"{pad}```")
            continue
        if _TABLE_BORDER.match(line):
            # a simple table has a top border, a header underline and a bottom border followed by a blank line
            pad = " " * _indent(line)
            out.append(f"{pad}```text")
            borders = 0
            while i < len(lines):
                out.append(lines[i])
                borders += bool(_TABLE_BORDER.match(lines[i]))
                i += 1
                if borders >= 2 and _TABLE_BORDER.match(lines[i - 1]) and (i == len(lines) or not lines[i].strip()):
                    break
            out.append(f"{pad}```")
            continue
        if stripped.endswith("::") and not stripped.startswith(("```", "|")):
            # a literal block follows: the next non-blank lines indented deeper than this paragraph
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            base = _indent(line)
            if j < len(lines) and _indent(lines[j]) > base:
                text_part = line.rstrip()[:-2].rstrip()
                out.append(text_part + ":" if text_part.strip() else "")
                out.append("")
                block: list[str] = []
                k = j
                while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > base):
                    block.append(lines[k])
                    k += 1
                while block and not block[-1].strip():
                    block.pop()
                deep = min(_indent(b) for b in block if b.strip())
                pad = " " * base
                out.append(f"{pad}```text")
                out.extend(pad + b[deep:] if b.strip() else "" for b in block)
                out.append(f"{pad}```")
                out.append("")
                i = k
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


class ReSTDocstrings(griffe.Extension):
    """Rewrites every loaded object's docstring with :func:`to_markdown` before it is parsed and rendered."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
