"""The engine interface over a running server: one request per prompt through a protocol
(:mod:`offpolicy.rollout.protocols`, :mod:`offpolicy.rollout.llamacpp`), the answers padded into a
:class:`~offpolicy.rollout.base.RolloutOutput`; weights into the server through a reload folder.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from offpolicy.rollout.base import RolloutOutput, check_prompt_ids
from offpolicy.rollout.http import ServerError, post_json
from offpolicy.rollout.protocols import ServerCompletion, ServerProtocol
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.weight_sync import ReloadFolder, check_reload_folder


def completions_to_output(prompt_ids: list[list[int]], parsed: list[ServerCompletion], k: int,
                          sampling: SamplingConfig | None) -> RolloutOutput:
    """Pad parsed answers into a :class:`RolloutOutput` (top-k ``[B, T, K]``: −inf / id 0 where fewer than K came
    back, e.g. after truncation)."""
    b, t = len(parsed), max((len(c.ids) for c in parsed), default=0)
    logp = torch.zeros(b, t)
    mask = torch.zeros(b, t, dtype=torch.bool)
    topk_logp = torch.zeros(b, t, k) if k > 0 else None
    topk_ids = torch.zeros(b, t, k, dtype=torch.long) if k > 0 else None
    for i, c in enumerate(parsed):
        n = len(c.ids)
        if n:
            logp[i, :n] = torch.tensor(c.logp, dtype=torch.float64).float()
            mask[i, :n] = True
        if k > 0 and n:
            assert topk_logp is not None and topk_ids is not None  # allocated above when k > 0
            assert c.top_ids is not None and c.top_logp is not None, "parsed with k > 0: top-k lists are set"
            topk_logp[i, :n] = -math.inf
            for j in range(n):
                m = min(k, len(c.top_ids[j]))
                topk_ids[i, j, :m] = torch.tensor(c.top_ids[j][:m], dtype=torch.long)
                topk_logp[i, j, :m] = torch.tensor(c.top_logp[j][:m], dtype=torch.float64).float()
    return RolloutOutput(prompt_ids=[list(p) for p in prompt_ids], completion_ids=[list(c.ids) for c in parsed],
                         logp=logp, mask=mask, topk_logp=topk_logp, topk_ids=topk_ids,
                         texts=[c.text for c in parsed], sampling=sampling)


class ServerRolloutEngine:
    """The engine interface (:class:`~offpolicy.rollout.base.RolloutEngine`) over a running server.

    Args:
        url: the server's base address, e.g. ``http://127.0.0.1:8000``.
        protocol: a :class:`ServerProtocol` (:class:`VLLMProtocol`, :class:`SGLangProtocol`,
            :class:`~offpolicy.rollout.llamacpp.LlamaCppProtocol`).
        vocab_size: the trainer's vocabulary: ids outside it are refused (None: not checked).
        timeout: seconds per request; a request not answered by then raises a
            :class:`~offpolicy.rollout.http.ServerError` naming the server, the request, the sync (the engine's
            count of :meth:`sync_weights` calls) and :attr:`timeout_setting`.
        tokenizer: optional, decodes ``texts`` when the server sends none.

    ``sync_weights`` cannot push tensors into a remote server: it writes the model into ``weights_dir`` — a
    :class:`~offpolicy.rollout.weight_sync.ReloadFolder` of the project's own on a disk both can read (a temporary
    folder on this machine when not given; never the model directory the server was started on) — then has the
    server reload from it (``weights_path``). The llama.cpp engine that owns its server exports and restarts instead.
    """

    def __init__(self, url: str, protocol: ServerProtocol, *, vocab_size: int | None = None, timeout: float = 120.0,
                 tokenizer=None, weights_dir: str | os.PathLike | None = None) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.url = url.rstrip("/")
        self.protocol = protocol
        self.vocab_size = vocab_size
        self.timeout = float(timeout)
        self.tokenizer = tokenizer
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self._reload_folder: ReloadFolder | None = None
        self.syncs = 0  # weight syncs so far: what a failed request names (the trainer syncs before every step)
        self.timeout_setting = "timeout"  # the setting a timed-out request names (the trainer's: rollout.server.timeout)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Write ``model`` into the reload folder (``weights_dir``, or a temporary folder on this machine) and have
        the server reload from there."""
        if not getattr(self.protocol, "can_reload", True):
            raise ValueError(f"sync_weights: a {self.protocol.name} server at {self.url} cannot take tensors or reload "
                             "weights; restart it on the new weights (LlamaCppRolloutEngine owns its server and does so)")
        if self._reload_folder is None:
            if self.weights_dir is None:
                self.weights_dir = Path(tempfile.mkdtemp(prefix="offpolicy-reload-"))
            self._reload_folder = ReloadFolder(self.weights_dir)
        self._reload_folder.write_model(model)
        self.syncs += 1
        self.reload_weights(str(self.weights_dir))

    full_logits = False  # score() gives the sampled tokens' log-probs, not [B, T, V] logits

    @property
    def scores_tokens(self) -> bool:
        """Whether :meth:`score` works with this protocol (vLLM's prompt log-probs)."""
        return hasattr(self.protocol, "score_request")

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
              cfg: SamplingConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs ``[B, T]`` (0 at padding) and mask of given completions under the server's numerics, teacher-
        forced (vLLM: prompt log-probs, the raw distribution at temperature 1; ``cfg`` must be None). What
        :mod:`offpolicy.rollout.sync_check` compares with the trainer after a reload."""
        request = getattr(self.protocol, "score_request", None)
        if request is None:
            raise ValueError(f"score: the {self.protocol.name} protocol cannot score given tokens")
        if cfg is not None:
            raise ValueError("cfg: a server's prompt log-probs are the raw distribution; score with cfg=None")
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"prompt_ids has {len(prompt_ids)} rows but completion_ids has {len(completion_ids)}")
        t = max((len(c) for c in completion_ids), default=0)
        logp, mask = torch.zeros(len(prompt_ids), t), torch.zeros(len(prompt_ids), t, dtype=torch.bool)
        for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
            what = f"{self.protocol.name} scoring request {i} ({self.protocol.path})"
            with self._naming_the_sync():
                answer = post_json(self.url + self.protocol.path, request(list(p), list(c)), timeout=self.timeout,
                                   what=what)
            values = self.protocol.parse_score(answer, list(p), list(c), where=what)  # type: ignore[attr-defined]
            if len(values) != len(c):  # never a shorter mask: the sync check would judge fewer tokens than sent
                raise ServerError(f"{what}: {len(values)} log-probs came back for {len(c)} completion tokens")
            logp[i, : len(values)] = torch.tensor(values)
            mask[i, : len(values)] = True
        return logp, mask

    def reload_weights(self, path: str) -> None:
        """Make the server load new weights from the folder ``path`` (on the server's disk). A folder the server
        cannot take as a whole model is refused first (:func:`~offpolicy.rollout.weight_sync.check_reload_folder`:
        e.g. ``save_pretrained``'s tied head stored once); whether the server then serves the new weights is what
        :class:`~offpolicy.rollout.sync_check.SyncCheck` verifies."""
        reload = getattr(self.protocol, "reload_weights", None)
        if reload is None:
            raise ValueError(f"reload_weights: the {self.protocol.name} protocol has no reload call")
        if Path(path).is_dir():  # a folder on this machine: checked here; a remote path is the server's to read
            check_reload_folder(path)
        with self._naming_the_sync():
            reload(self.url, str(path), timeout=self.timeout)

    @contextlib.contextmanager
    def _naming_the_sync(self) -> Iterator[None]:
        """A request's :class:`ServerError` (refused, timed out, broken off, an HTTP error) with the sync it
        belongs to and the timeout's setting after it: ``"... (at sync 3; rollout.server.timeout: 30 s)"``."""
        try:
            yield
        except ServerError as err:
            # the llama.cpp engine syncs by restarting its server: one sync_log entry per sync
            syncs = max(self.syncs, len(getattr(self, "sync_log", ())))
            when = f"at sync {syncs}" if syncs else "before the first sync"
            raise ServerError(f"{err} ({when}; {self.timeout_setting}: {self.timeout:g} s)") from None

    def generate(self, prompt_ids: list[list[int]], cfg: SamplingConfig, *, seed: int) -> RolloutOutput:
        """One request per prompt, row i with seed ``seed + i`` (sequential: reproducible on one server slot)."""
        if not isinstance(cfg, SamplingConfig):
            raise ValueError(f"cfg must be a SamplingConfig, got {type(cfg).__name__}")  # noqa: TRY004 - convention
        check_prompt_ids(prompt_ids, self.vocab_size)
        applied = self.protocol.applied(cfg)
        parsed = []
        for i, prompt in enumerate(prompt_ids):
            what = f"{self.protocol.name} request {i} ({self.protocol.path})"
            with self._naming_the_sync():
                answer = post_json(self.url + self.protocol.path,
                                   self.protocol.request(list(prompt), cfg, int(seed) + i), timeout=self.timeout,
                                   what=what)
            c = self.protocol.parse(answer, cfg, where=what, vocab_size=self.vocab_size)
            if c.missing:
                fill = getattr(self.protocol, "fill_missing", None)
                if fill is None:
                    raise ServerError(f"{what}: no log-prob for positions {c.missing}")
                c = fill(self.url, list(prompt), c, cfg, timeout=self.timeout, where=what)
            c.check_lengths(what)
            if any(math.isnan(v) for v in c.logp):
                raise ServerError(f"{what}: a sampled token has no log-prob (NaN)")
            if len(c.ids) > cfg.max_new_tokens:
                raise ServerError(f"{what}: {len(c.ids)} tokens came back for max_new_tokens={cfg.max_new_tokens}")
            if not c.text and self.tokenizer is not None:
                c = replace(c, text=self.tokenizer.decode(c.ids, skip_special_tokens=True))
            parsed.append(c)
        return completions_to_output(prompt_ids, parsed, cfg.logprobs_topk, applied)
