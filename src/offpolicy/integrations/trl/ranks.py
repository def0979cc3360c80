"""How many processes a TRL run has, as torch.distributed sees it — the one test behind every "several processes?"
branch of the integration (the sigma all-reduce of ALP, the sync check's verdict, the weight-push choice) — and
how an exception on one rank reaches all of them.

:func:`every_rank_raises` wraps the plug-in's per-sync and per-step work (the weight push, the sync check and its
engine scoring, the loss's extra work): an exception raised inside it on any rank is raised on every rank when
each leaves the block. Without it the failing rank dies and the others wait in TRL's next collective until the
launcher kills them, their logs saying nothing of why.

The verdicts travel through the process group's key-value store (torchrun's TCP store), not through a
collective: a rank that fails half-way through a block never issues a collective the others do not (an
all-gather of verdicts meeting another rank's FSDP all-gather would hang or mix their data). Each rank writes its
verdict under the block's number and waits for everyone's; a rank that failed waits at most
:data:`FAILED_RANK_WAIT` seconds for the others (one left blocked in a collective of its block that the failing
rank skipped — an FSDP gather — never writes) and then raises its own error alone, as before.

The store is the default group's own (:func:`_default_store`): torch 2.13 has no public getter for it, so the private
``distributed_c10d._get_default_store`` is read, on the torch releases the adapter is tested with only; on another
(or where it is gone) the failing rank raises alone, as it did before this module, and every other rank goes on.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

FAILED_RANK_WAIT = 60.0  # seconds a failed rank waits for the others' verdicts before it raises alone
_KEY = "offpolicy/verdict"


def world_size(group: Any = None) -> int:
    """The number of processes in ``group`` (the default group); 1 when torch.distributed is not initialised.

    >>> world_size()        # a plain process
    1
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


class RankFailure(RuntimeError):
    """Another rank's exception, raised on this rank (its type could not be rebuilt from its message)."""


class _Blocks:
    """This process's count of :func:`raise_on_any_rank` calls: every rank calls it at the same points, so the
    count names the same block on every rank."""

    count = 0
    warned = False  # _default_store's notice, once per process


def _payload(error: BaseException | None) -> str:
    """A verdict as the store holds it: "" for none, else the error's type and message as JSON."""
    if error is None:
        return ""
    kind = type(error)
    return json.dumps({"module": kind.__module__, "type": kind.__qualname__, "text": str(error)})


def _rebuilt(rank: int, raw: bytes) -> BaseException:
    """Rank ``rank``'s error as this rank raises it: the same type with ``"rank R: "`` before its message where the
    type takes a message alone (``SyncCheckError``, ``ValueError``, ``ServerError``), else a :class:`RankFailure`."""
    fields = json.loads(raw)
    message = f"rank {rank}: {fields['text']}"
    try:
        kind: Any = importlib.import_module(fields["module"])
        for part in fields["type"].split("."):
            kind = getattr(kind, part)
        if isinstance(kind, type) and issubclass(kind, Exception):
            error = kind(message)
            if str(error) == message:
                return error
    except Exception:  # noqa: BLE001 - a type this rank cannot import or build: the message travels alone
        pass
    return RankFailure(f"rank {rank}: {fields['type']}: {fields['text']}")


def _default_store() -> Any | None:
    """The default process group's key-value store (torchrun's TCP store, or the one its init method built), or
    None on a torch release outside the tested range or without the private getter (logged once)."""
    import torch
    from torch.distributed import distributed_c10d

    from offpolicy.integrations.versions import VERSIONS

    # no public getter in torch 2.13; a TCPStore rebuilt from MASTER_ADDR / MASTER_PORT would miss file:// and tcp://
    getter = getattr(distributed_c10d, "_get_default_store", None)
    if getter is None or not VERSIONS["torch"].supports(torch.__version__):
        if not _Blocks.warned:
            _Blocks.warned = True
            logger.warning("every_rank_raises: torch %s is outside the tested range or has no "
                           "distributed_c10d._get_default_store: an exception is raised on its own rank only",
                           torch.__version__)
        return None
    return getter()


def raise_on_any_rank(error: BaseException | None) -> None:
    """Raise ``error`` (this rank's, or None) on this rank, or the first other rank's error when this one has none.
    Every rank must call it at the same points. One store write, one wait and one read per rank per call, only
    with several processes."""
    processes = world_size()
    if processes == 1:
        if error is not None:
            raise error
        return
    store = _default_store()
    if store is None:  # no store to share verdicts through: this rank's own error, as without this module
        if error is not None:
            raise error
        return
    block, rank = _Blocks.count, dist.get_rank()
    _Blocks.count += 1
    keys = [f"{_KEY}/{block}/{r}" for r in range(processes)]
    store.set(keys[rank], _payload(error))
    try:
        if error is None:  # the others are still in this block: wait as long as a collective would
            store.wait(keys)
        else:
            store.wait(keys, datetime.timedelta(seconds=FAILED_RANK_WAIT))
    except Exception:  # noqa: BLE001 - a rank that never came (blocked elsewhere, or gone): raise what is known
        if error is not None:
            raise error from None
        raise
    verdicts = store.multi_get(keys)
    if block > 0:  # every rank has read block − 1 before it wrote this block's verdict
        store.delete_key(f"{_KEY}/{block - 1}/{rank}")
    if error is not None:
        raise error
    for other, raw in enumerate(verdicts):
        if raw:
            raise _rebuilt(other, raw)


@contextlib.contextmanager
def every_rank_raises() -> Iterator[None]:
    """An exception raised inside the block on any rank is raised on every rank as it leaves the block
    (:func:`raise_on_any_rank`); every rank must enter the block at the same points. Also a decorator."""
    error: Exception | None = None
    try:
        yield
    except Exception as err:  # noqa: BLE001 - any failure must reach the other ranks, whatever its type
        error = err
    raise_on_any_rank(error)
