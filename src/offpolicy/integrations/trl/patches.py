"""Every place TRL offers no hook, in one module: scoped patches, each gated on the TRL release it was written
against, each citing the TRL code it stands in for, each restoring what it changed when its ``with`` block ends
(an exception included) — nothing process-wide stays changed after ``OffPolicyGRPOTrainer.__init__`` returns.

* :func:`extra_llm_kwargs` — ``trl/generation/vllm_generation.py`` (TRL 1.16), ``VLLMGeneration._init_vllm``:
  ``self.llm = LLM(model=..., ...)`` takes no extra ``vllm.LLM`` arguments; the module global ``LLM`` is wrapped
  while the trainer builds its engine.
* :func:`server_sync_choice` — ``trl/generation/vllm_generation.py`` (TRL 1.16), ``VLLMGeneration.__init__``:
  ``self.vllm_client.init_communicator(device=accelerator.device)`` opens an NCCL group that raises on a CPU
  trainer; ``VLLMClient.init_communicator`` is replaced while the trainer is built.
* :func:`request_timeouts` — ``trl/generation/vllm_client.py`` (TRL 1.16), ``VLLMClient._post`` / ``_get`` /
  ``get_server_info`` / ``reset_prefix_cache``: ``self.session.post(url, **kwargs)`` with no timeout, so a server
  that accepts and never answers holds generation and the weight push forever; the client's own session's
  ``request`` is given one while the trainer trains.

What else the adapter reads of TRL's internals without changing it (``VLLMGeneration._iter_named_params``, the
stream TRL's own sync sends) is named where it is read (:mod:`offpolicy.integrations.trl.vllm_sync`).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import torch

SERVER_SYNCS = ("auto", "nccl", "files")
REQUEST_TIMEOUT_SETTING = "vllm_request_timeout"  # OffPolicyGRPOTrainer's keyword (default GRPOConfig.vllm_server_timeout)


def _target(module: Any, name: str, what: str) -> Any:
    """The attribute a patch replaces; a TRL release without it is refused in one line (the patch was written
    against TRL 1.16: see :mod:`offpolicy.integrations.versions`)."""
    target = getattr(module, name, None)
    if target is None:
        from offpolicy.integrations.versions import installed_version

        raise RuntimeError(f"{what}: TRL {installed_version('trl')} has no {module.__name__}.{name}, which this "
                           "patch stands in for (written against TRL 1.16); use the TRL version the adapter is "
                           "tested with")
    return target


@contextlib.contextmanager
def extra_llm_kwargs(kwargs: dict[str, Any]) -> Iterator[None]:
    """Add ``kwargs`` to the ``vllm.LLM(...)`` call TRL 1.16 makes in ``VLLMGeneration._init_vllm`` (colocate mode),
    which takes no extra arguments of its own: e.g. ``enforce_eager`` (vLLM's CPU backend otherwise compiles for
    ≈ 50 s at start-up), ``dtype``, ``max_logprobs`` (vLLM's default 20 caps ``topk_logprobs``). TRL's ``LLM`` is
    back when the block ends."""
    if not kwargs:
        yield
        return
    from trl.generation import vllm_generation

    if getattr(vllm_generation, "LLM", None) is None and importlib.util.find_spec("vllm") is None:
        yield  # without vLLM TRL imports no LLM and builds none: nothing to add the arguments to
        return
    original = _target(vllm_generation, "LLM", "extra_llm_kwargs")

    def llm(*args: Any, **given: Any) -> Any:
        return original(*args, **{**given, **kwargs})

    setattr(vllm_generation, "LLM", llm)  # noqa: B010 - the module global TRL's _init_vllm reads
    try:
        yield
    finally:
        setattr(vllm_generation, "LLM", original)  # noqa: B010


def check_server_sync(setting: str) -> str:
    """``vllm_server_sync``: ``"auto"`` (files when the trainer is not on a CUDA device — TRL's NCCL transfer needs
    one — else TRL's own), ``"nccl"`` (TRL's own), ``"files"`` (:class:`~offpolicy.integrations.trl.vllm_sync.FileSync`)."""
    if setting not in SERVER_SYNCS:
        raise ValueError(f"vllm_server_sync must be one of {SERVER_SYNCS}, got {setting!r}")
    return setting


@contextlib.contextmanager
def server_sync_choice(cfg: Any, setting: str) -> Iterator[None]:
    """While TRL's ``GRPOTrainer.__init__`` runs in server mode, decide how weights will reach the server when TRL
    opens its NCCL group (``VLLMClient.init_communicator``, which raises on a CPU trainer and without the server's
    ``--weight-transfer-config``): with ``"files"``, or ``"auto"`` on a device that is not CUDA, the group is not
    opened and the client is marked (``offpolicy_file_sync``) for the file sync; otherwise TRL opens it as usual.
    TRL's ``init_communicator`` is back when the block ends."""
    check_server_sync(setting)
    if setting == "nccl" or not (getattr(cfg, "use_vllm", False) and getattr(cfg, "vllm_mode", None) == "server"):
        yield
        return
    from trl.generation.vllm_client import VLLMClient

    original = _target(VLLMClient, "init_communicator", "server_sync_choice")

    def choose(self: Any, device: Any = 0) -> None:
        kind = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if setting == "files" or kind.type != "cuda":
            self.communicator = None
            self.offpolicy_file_sync = True
            return
        original(self, device)

    setattr(VLLMClient, "init_communicator", choose)  # noqa: B010 - restored below
    try:
        yield
    finally:
        setattr(VLLMClient, "init_communicator", original)  # noqa: B010


def check_request_timeout(value: Any) -> float | None:
    """``vllm_request_timeout``: seconds a request of TRL's vLLM client may take (generation, the weight push, the
    server's info), or None for ``GRPOConfig.vllm_server_timeout`` (TRL's 240 s; the sync check's probe waits as
    long)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"vllm_request_timeout must be a number of seconds > 0 or None, got {value!r}")
    return float(value)


@contextlib.contextmanager
def request_timeouts(client: Any, timeout: float, *, when: Callable[[], str] = lambda: "?") -> Iterator[None]:
    """While the block runs, every request TRL's ``client`` (a ``VLLMClient``) sends through its session — TRL 1.16
    sends them all with no timeout — is answered within ``timeout`` seconds or raises
    :class:`~offpolicy.rollout.http.ServerError` naming the server, the request, ``when()`` (the training step)
    and the setting. Each try of TRL's retry policy gets twice the timeout as its own, so a request left behind by a
    timed-out wait ends on its own. Only this client's session changes (an attribute of the instance, removed when the block
    ends): other clients in the process keep TRL's behaviour; a client that is not TRL's ``VLLMClient`` (one's own
    stand-in) is left as it is."""
    from trl.generation.vllm_client import VLLMClient

    if not isinstance(client, VLLMClient):
        yield
        return
    session = _target(client, "session", "request_timeouts")
    original = _target(session, "request", "request_timeouts")
    url = getattr(client, "base_url", "?")

    def request(method: str, address: str, *args: Any, **kwargs: Any) -> Any:
        from offpolicy.rollout.http import call_within

        if kwargs.get("timeout") is None:  # twice the wait: the wait's own error comes first, never a try's
            kwargs["timeout"] = 2 * timeout
        path = str(address)[len(url):] if str(address).startswith(url) else str(address)
        return call_within(lambda: original(method, address, *args, **kwargs), timeout,
                           what=f"vLLM server {url}", request=f"TRL's {str(method).upper()} {path or '/'}",
                           when=when(), setting=f"{REQUEST_TIMEOUT_SETTING}: {timeout:g} s")

    had = "request" in vars(session)
    session.request = request
    try:
        yield
    finally:
        if had:
            session.request = original
        else:
            del session.request  # the class's method again
