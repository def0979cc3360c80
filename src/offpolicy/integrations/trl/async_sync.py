"""Weight transfer for TRL 1.16's ``AsyncGRPOTrainer`` without NCCL: the trainer's streamed weights are written to a
reload folder and a vLLM server reloads them (imports no TRL).

TRL's default ``WeightTransferClient`` streams the weights into the vLLM server over NCCL (CUDA on both sides).
:class:`FileWeightTransfer` is a ``WeightTransferProtocol`` that works wherever the server can read the folder — on
vLLM's CPU build among others: ``send_weights`` streams TRL's ``(name, tensor)`` pairs into a
:class:`~offpolicy.rollout.weight_sync.ReloadFolder` (shard by shard, the index renamed into place last; a tied output
head under its own name too, or vLLM's CPU backend keeps its old repacked head) and calls vLLM's dev-mode reload
(:func:`~offpolicy.rollout.protocols.vllm_reload_weights`: ``/pause``, ``reload_weights``, ``/reset_prefix_cache``,
``/resume``; the server runs with ``VLLM_SERVER_DEV_MODE=1``). Pass it as ``weight_transfer=``;
:class:`~offpolicy.integrations.trl.OffPolicyAsyncGRPOTrainer` binds it to the model it trains (the tied names).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import torch

from offpolicy.rollout.protocols import vllm_reload_weights
from offpolicy.rollout.weight_sync import ReloadFolder

__all__ = ["FileWeightTransfer"]


class FileWeightTransfer:
    """``WeightTransferProtocol`` (TRL 1.16's async trainer) through a reload folder into the vLLM server at
    ``url`` (see the module docstring). ``folder``: the reload folder (a temporary one by default; never a model
    directory), readable by the server; ``timeout``: seconds per server call. ``pushes`` counts the syncs."""

    def __init__(self, url: str, folder: str | os.PathLike | None = None, *, timeout: float = 240.0) -> None:
        if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ValueError(f"url must be the server's http(s) address, got {url!r}")
        self.url = url.rstrip("/")
        self.folder = str(folder) if folder is not None else tempfile.mkdtemp(prefix="offpolicy-async-weights-")
        self.timeout = float(timeout)
        self.aliases: dict[str, list[str]] = {}
        self.pushes = 0
        self._reload: ReloadFolder | None = None

    def bind(self, model: torch.nn.Module) -> None:
        """Take the tied names of ``model`` (``{"model.embed_tokens.weight": ["lm_head.weight"]}``): TRL streams
        ``named_parameters``, which yields a tied tensor once."""
        from offpolicy.integrations.trl.vllm_sync import _tied_aliases

        self.aliases = _tied_aliases(model)

    def init_weight_transfer(self) -> None:
        if self._reload is None:
            self._reload = ReloadFolder(self.folder)

    def pause(self) -> None:
        pass  # the reload pauses and resumes the server itself, around reload_weights

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.init_weight_transfer()
        assert self._reload is not None  # set just above
        self._reload.write(((name, t.detach().cpu()) for name, t in iterator), aliases=self.aliases)
        vllm_reload_weights(self.url, self.folder, weights_path=self.folder, timeout=self.timeout)
        self.pushes += 1

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass
