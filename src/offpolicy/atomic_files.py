"""Files written whole or not at all: a temporary file beside the target, moved onto it with ``os.replace`` (atomic on
POSIX) once it is complete, removed when writing it fails. A crash leaves the old file or the new one, never half of
one; at most a temporary named ``prefix…suffix`` (which a caller that cleans up leftovers can recognise).

>>> import tempfile
>>> from pathlib import Path
>>> folder = Path(tempfile.mkdtemp())
>>> write_atomic(folder / "a.json", '{"step": 3}')
>>> (folder / "a.json").read_text(), sorted(p.name for p in folder.iterdir())
('{"step": 3}', ['a.json'])
>>> with replacing(folder / "a.json") as tmp:
...     _ = tmp.write_text("half")
...     raise RuntimeError("the writer failed")
Traceback (most recent call last):
...
RuntimeError: the writer failed
>>> (folder / "a.json").read_text(), sorted(p.name for p in folder.iterdir())
('{"step": 3}', ['a.json'])
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | os.PathLike, *, prefix: str | None = None, suffix: str = "") -> Iterator[Path]:
    """A new empty temporary file in ``path``'s folder (created if missing), named ``prefix…suffix`` (default prefix
    ``.<name>-``); when the block ends normally it replaces ``path``, when it raises it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-" if prefix is None else prefix, suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes, *, prefix: str | None = None, suffix: str = "") -> None:
    """``data`` (text as UTF-8, or bytes) as the whole content of ``path``, through :func:`replacing`."""
    with replacing(path, prefix=prefix, suffix=suffix) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
