"""HTTP to a rollout server: JSON requests, waiting for a server to come up, and the field checks every answer
parser uses. A failure is a :class:`ServerError` that names the request and the field, never a silent NaN.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import torch


class ServerError(ValueError):
    """A server is down, timed out, or answered something the trainer cannot use; the message names the request
    and the field."""


def post_json(url: str, body: dict | None, *, timeout: float, what: str, as_bytes: bool = False) -> Any:
    """POST ``body`` as JSON (GET when ``body`` is None) and return the decoded answer (its bytes if ``as_bytes``);
    :class:`ServerError` naming ``what`` (the request) on a refused connection, a timeout, an HTTP error status or
    malformed JSON."""
    late = f"did not answer within {timeout:g} s: is it running?"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as err:
        detail = err.read()[:300].decode("utf-8", "replace")
        raise ServerError(f"{what}: {url} answered HTTP {err.code}: {detail}") from None
    except TimeoutError:
        raise ServerError(f"{what}: {url} {late}") from None
    except http.client.HTTPException as err:  # the server died while answering (incomplete read, bad status line)
        raise ServerError(f"{what}: {url} broke off its answer ({type(err).__name__}: {err})") from None
    except (urllib.error.URLError, ConnectionError, OSError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise ServerError(f"{what}: {url} {late}") from None
        raise ServerError(f"{what}: cannot reach {url} ({reason}): is it running?") from None
    if as_bytes:
        return raw
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ServerError(f"{what}: {url} answered malformed JSON ({err.msg if hasattr(err, 'msg') else err}): "
                          f"{raw[:120]!r}") from None


def call_within(call: Callable[[], Any], timeout: float, *, what: str, request: str, when: str,
                setting: str) -> Any:
    """``call()``'s result within ``timeout`` seconds, for a client that sets no timeout of its own (TRL's
    ``VLLMClient``). Past it, :class:`ServerError` ``"{what} did not answer {request} within {timeout} s at {when}:
    is it running? ({setting})"``; an exception of ``call`` becomes a :class:`ServerError` naming the same. The call
    runs in a daemon thread, left behind on a timeout: a request that never returns cannot be cancelled, and must
    not keep the process from exiting."""
    done = threading.Event()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = err
        done.set()

    threading.Thread(target=run, name=f"offpolicy-call {what}", daemon=True).start()
    if not done.wait(timeout):
        raise ServerError(f"{what} did not answer {request} within {timeout:g} s at {when}: is it running? "
                          f"({setting})")
    if "error" in outcome:
        err = outcome["error"]
        first = str(err).splitlines()[0][:300] if str(err) else ""
        raise ServerError(f"{what} failed on {request} at {when} ({type(err).__name__}: {first}): is it "
                          "running?") from err
    return outcome["value"]


def wait_until_healthy(url: str, *, timeout: float, what: str, healthy: Callable[[bytes], bool] = lambda raw: True,
                       exited: Callable[[], str | None] = lambda: None, poll: float = 0.05) -> None:
    """Poll ``GET url`` until it answers and ``healthy(answer bytes)``; :class:`ServerError` naming ``what`` after
    ``timeout`` seconds, or at once with ``exited()``'s message when that returns one (the server process died)."""
    deadline = time.monotonic() + timeout
    while True:
        died = exited()
        if died is not None:
            raise ServerError(f"{what}: {died}")
        try:
            if healthy(post_json(url, None, timeout=5.0, what=what, as_bytes=True)):
                return
        except ServerError:
            pass
        if time.monotonic() > deadline:
            raise ServerError(f"{what}: not ready within {timeout:g} s")
        time.sleep(poll)


def get_field(obj: Any, key: str | int, where: str, kind: type | tuple[type, ...] | None = None) -> Any:
    """``obj[key]``, or a :class:`ServerError` that names ``where`` and the key (and the expected type).

    >>> get_field({"a": 1}, "b", "request 0: answer")
    Traceback (most recent call last):
    ...
    offpolicy.rollout.http.ServerError: request 0: answer has no field 'b'
    """
    try:
        value = obj[key]
    except (KeyError, IndexError, TypeError):
        raise ServerError(f"{where} has no field {key!r}") from None
    if kind is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ServerError(f"{where}.{key} must be {names}, got {type(value).__name__}: {str(value)[:80]}")
    return value


LARGEST_VOCAB = 2**18  # 262,144 (Gemma 3's), the largest vocabulary in common use: the slack when none is known


def logprob_slack(vocab: int | None = None, dtype: torch.dtype = torch.float32) -> float:
    """How far above 0 an engine's log-prob can come out through rounding alone: a log-prob above 0 is the sampled
    token at p ≈ 1, the argmax, where z_y − m = 0 exactly and the other shifted logits add ≈ nothing — so the
    logits' magnitude drops out and what is left is the log-softmax's V-term sum and its log,
    :func:`~offpolicy.tolerances.log_softmax_tolerance` at A = 0 (servers report log-probs in float32;
    ``vocab`` None: :data:`LARGEST_VOCAB`).

    >>> round(logprob_slack(151936), 6)   # 8 · 1.19e-7 · (2 log V + √V/2 + 1), Qwen's vocabulary
    0.00021
    """
    from offpolicy.tolerances import log_softmax_tolerance

    return float(log_softmax_tolerance(dtype, 0.0, LARGEST_VOCAB if vocab is None else int(vocab)))


def check_logprob(value: Any, where: str, *, vocab: int | None = None) -> float:
    """A finite log-prob ≤ 0 (up to :func:`logprob_slack` of rounding over ``vocab`` logits, clamped to 0), or
    −inf; anything else (NaN, a string, > 0) is refused, saying what the server should send."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ServerError(f"{where} must be a number, got {type(value).__name__}: {str(value)[:80]}")
    v = float(value)
    slack = logprob_slack(vocab)
    if math.isnan(v) or v > slack or v == math.inf:
        raise ServerError(f"{where} must be a log-prob ≤ 0 (float32 rounding allows {slack:.2g} over a vocabulary of "
                          f"{LARGEST_VOCAB if vocab is None else vocab}), got {v}: the server is not reporting "
                          "log-probs there (a probability or a logit?); check its log-prob settings (vLLM: "
                          "--logprobs-mode processed_logprobs)")
    return min(v, 0.0)


def check_token(value: Any, where: str, vocab_size: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ServerError(f"{where} must be a token id ≥ 0, got {str(value)[:80]}")
    if vocab_size is not None and value >= vocab_size:
        raise ServerError(f"{where} = {value} is outside the trainer's vocabulary of {vocab_size}")
    return value
