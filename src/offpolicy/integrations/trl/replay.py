"""Sampling replay inside TRL: the trainer scores every completion token under the recipe TRL's engine sampled with.

TRL hands the same recipe to both engines — ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``
(and ``generation_kwargs``) — but the engines apply it in different orders (DVP, arXiv 2512.23087 §3; DeepSeek-V3.2
"keep sampling mask"):

* Hugging Face ``generate``: repetition penalty → temperature → top-k → top-p → min-p
  (:data:`offpolicy.rollout.sampling.TRUNCATION_ORDER`);
* vLLM: penalties (repetition, frequency, presence) → temperature → min-p → top-k / top-p
  (:data:`offpolicy.corrections.vocabulary.SUPPORT_ORDER`).

The replayed log-prob of token y at a position is z_y/T − logsumexp_{a∈S} z_a/T over the support S the engine's
filters leave (after the penalties), i.e. the engine's processed log-prob μ evaluated with the trainer's weights.
:func:`replay_logp` computes it from hidden states and the lm_head in row chunks: without top-k / top-p / penalties
it is the fused kernel (:func:`offpolicy.kernels.fused_token_stats`: DVP's min-p statistics, no ``[N, V]`` tensor at
all); otherwise each chunk of rows builds its ``[rows, V]`` logits, replays the filters with
:func:`offpolicy.corrections.vocabulary.replay_support_logp`, and is recomputed in the backward pass
(:func:`offpolicy.kernels.row_maps.head_row_map`), so at most one chunk's ``[rows, V]`` scratch is alive at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from offpolicy.corrections.vocabulary import SUPPORT_ORDER, replay_support_logp, sampling_support_mask
from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES
from offpolicy.kernels.fused import fused_token_stats
from offpolicy.kernels.row_maps import head_row_map
from offpolicy.rollout.sampling import TRUNCATION_ORDER, SamplingConfig, TokenHistory, apply_history_processors

# the filter order of each engine TRL can generate with
ENGINE_ORDERS: dict[str, tuple[str, ...]] = {"hf": TRUNCATION_ORDER, "vllm": SUPPORT_ORDER}
# generation_kwargs keys that change the sampling distribution and are not replayed: refused when replay is on
UNREPLAYED_KEYS = frozenset({
    "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h", "no_repeat_ngram_size", "encoder_repetition_penalty",
    "bad_words_ids", "bad_words", "sequence_bias", "logit_bias", "suppress_tokens", "begin_suppress_tokens",
    "min_new_tokens", "min_length", "min_tokens", "allowed_token_ids", "guidance_scale", "logits_processors",
    "structured_outputs", "guided_decoding",
})
_RECIPE_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
_VLLM_ONLY = ("frequency_penalty", "presence_penalty")


def trl_engine(args: Any) -> str:
    """``"vllm"`` when ``args.use_vllm`` (a ``GRPOConfig``), else ``"hf"`` (TRL's ``generate`` path).

    >>> from types import SimpleNamespace as A
    >>> trl_engine(A(use_vllm=True)), trl_engine(A(use_vllm=False))
    ('vllm', 'hf')
    """
    return "vllm" if getattr(args, "use_vllm", False) else "hf"


def trl_sampling_recipe(args: Any) -> SamplingConfig:
    """The recipe TRL hands its engine, from a ``GRPOConfig``: temperature, top-k (0 / −1 = off), top-p (1 = off),
    min-p (None / 0 = off), repetition penalty, and — vLLM only — frequency / presence penalties from
    ``generation_kwargs`` (which override the named fields, as in TRL). A ``generation_kwargs`` key that changes the
    distribution and is not replayed raises ``ValueError`` naming it.

    >>> from types import SimpleNamespace as A
    >>> r = trl_sampling_recipe(A(temperature=0.7, top_k=0, top_p=0.9, min_p=None, repetition_penalty=1.0,
    ...                           max_completion_length=8, use_vllm=False, generation_kwargs={"top_k": 5}))
    >>> r.temperature, r.top_k, r.top_p, r.min_p, r.processors
    (0.7, 5, 0.9, None, ('temperature', 'top_k', 'top_p'))
    """
    engine = trl_engine(args)
    extra = dict(getattr(args, "generation_kwargs", None) or {})
    bad = sorted(k for k in extra if k in UNREPLAYED_KEYS or (engine == "hf" and k in _VLLM_ONLY))
    if bad:
        raise ValueError(f"generation_kwargs: {bad[0]!r} changes the sampling distribution and is not replayed by "
                         "the trainer's scoring; remove it or turn sampling replay off")
    value = {k: extra.get(k, getattr(args, k, None)) for k in _RECIPE_KEYS}
    top_k = value["top_k"]
    top_p = value["top_p"]
    min_p = value["min_p"]
    penalties: dict[str, Any] = {k: float(extra[k]) for k in _VLLM_ONLY if k in extra} if engine == "vllm" else {}
    return SamplingConfig(
        max_new_tokens=int(getattr(args, "max_completion_length", 16) or 16),
        temperature=float(value["temperature"] if value["temperature"] is not None else 1.0),
        top_k=int(top_k) if top_k is not None and top_k > 0 else None,
        top_p=float(top_p) if top_p is not None and top_p < 1.0 else None,
        min_p=float(min_p) if min_p is not None and min_p > 0.0 else None,
        repetition_penalty=float(value["repetition_penalty"] if value["repetition_penalty"] is not None else 1.0),
        **penalties,
    )


@dataclass
class ReplayHistory:
    """The token history the penalties read, for the flattened scored positions of a ``[B, T]`` completion batch.

    ``prompts``: the B prompts as the engine saw them (HF ``generate``: the left-padded row, pad tokens included —
    its repetition penalty sees them; vLLM: the unpadded prompt). ``completion_ids`` / ``completion_mask`` [B, T].
    ``rows`` [N] are the flat indices b·T + t of the positions being scored (row-major).
    """

    prompts: list[list[int]]
    completion_ids: Tensor
    completion_mask: Tensor
    rows: Tensor

    def chunk(self, a: int, b: int, vocab: int) -> TokenHistory:
        """:class:`TokenHistory` ``[b − a, V]`` of scored positions ``rows[a:b]``: prompt tokens seen, and the counts of
        the completion's tokens strictly before each position. Built per chunk (never ``[N, V]``).

        >>> h = ReplayHistory([[3], [0]], torch.tensor([[1, 1, 2], [2, 0, 0]]), torch.tensor([[1, 1, 1], [1, 0, 0]]),
        ...                   torch.tensor([0, 1, 2, 3]))
        >>> c = h.chunk(0, 4, 4)
        >>> c.output_counts.tolist()   # before (0,0): nothing; (0,1): one 1; (0,2): two 1s; (1,0): nothing
        [[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
        >>> c.prompt_seen[:, 3].tolist(), c.prompt_seen[:, 0].tolist()
        ([True, True, True, False], [False, False, False, True])
        """
        device = self.completion_ids.device
        t_len = self.completion_ids.shape[1]
        rows = self.rows[a:b].to(device)
        bi, ti = rows // t_len, rows % t_len
        width = max((len(p) for p in self.prompts), default=0)
        prompt = torch.full((len(self.prompts), max(width, 1)), vocab, dtype=torch.long, device=device)
        for i, p in enumerate(self.prompts):
            if p:
                prompt[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long, device=device)
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompt[bi], True)
        before = torch.arange(t_len, device=device)[None, :] < ti[:, None]
        ids = torch.where(before & self.completion_mask[bi].bool(), self.completion_ids[bi].long(),
                          torch.full((), vocab, dtype=torch.long, device=device))
        counts = torch.zeros(len(rows), vocab + 1, device=device).scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
        return TokenHistory(seen[:, :vocab], counts[:, :vocab])


class ReplayedLogProbs(NamedTuple):
    """``logp`` [N] the replayed log-prob (a finite stand-in where the token is outside the support), ``inside`` [N]
    the token is in the trainer's support (else its ratio is 0: drop it), ``mass`` [N] the retained mass Z of the
    support under the (penalised, tempered) distribution."""

    logp: Tensor
    inside: Tensor
    mass: Tensor


def penalised(z: Tensor, recipe: SamplingConfig, history: TokenHistory | None) -> Tensor:
    """One chunk's float32 logits ``z`` [rows, V] after the recipe's penalties (``z`` itself when it has none)."""
    return apply_history_processors(z, recipe, history) if recipe.reads_history else z


def support_scores(z: Tensor, targets: Tensor, recipe: SamplingConfig, order: Sequence[str]) -> tuple[Tensor, Tensor,
                                                                                                      Tensor]:
    """(logp, inside, mass) ``[rows]`` of one chunk's penalised float32 logits ``z`` [rows, V] (:func:`penalised`):
    the replayed log-prob of ``targets`` on the support the recipe's filters leave in ``order``
    (:func:`~offpolicy.corrections.vocabulary.replay_support_logp`, differentiable), whether the target is inside it,
    and the support's retained mass Z (no gradient)."""
    logp, inside = replay_support_logp(z, targets, top_k=recipe.top_k, top_p=recipe.top_p, min_p=recipe.min_p,
                                       temperature=recipe.temperature, order=order)
    with torch.no_grad():  # Z = exp(logsumexp_S − logsumexp_V) = π(y) / π_S(y)
        scaled = z.detach() / recipe.temperature
        full = scaled.gather(-1, targets[:, None])[:, 0] - scaled.logsumexp(-1)
        mass = torch.exp(full - logp.detach()).clamp(max=1.0)
    return logp, inside, mass


def support_entropy(z: Tensor, recipe: SamplingConfig, order: Sequence[str]) -> Tensor:
    """Entropy ``[rows]`` of π_S from one chunk's penalised float32 logits ``z`` [rows, V] (:func:`penalised`):
    tempered and renormalised on the support S the recipe's filters leave in ``order``,

        H(π_S) = −Σ_{a∈S} π_S(a) log π_S(a),   π_S(a) = exp(z_a/T) / Σ_{b∈S} exp(z_b/T);

    differentiable in ``z`` (the support is fixed).

    >>> # z = (3, 2, 1, 0), top-k 2: π_S = softmax(3, 2) = (0.7311, 0.2689), H = 0.5822
    >>> support_entropy(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), SamplingConfig(top_k=2), ("top_k", "top_p", "min_p"))
    tensor([0.5822])
    """
    support = sampling_support_mask(z.detach(), top_k=recipe.top_k, top_p=recipe.top_p, min_p=recipe.min_p,
                                    temperature=recipe.temperature, order=order)
    logp = (z / recipe.temperature).masked_fill(~support, float("-inf")).log_softmax(-1)
    inside = logp.masked_fill(~support, 0.0)  # 0 · log 0 is 0, not NaN
    return -(inside.exp() * inside).sum(-1)


def fused_recipe(recipe: SamplingConfig) -> bool:
    """The recipe is temperature and min-p alone: :func:`replay_logp` scores it with the fused kernel."""
    return recipe.top_k is None and recipe.top_p is None and not recipe.reads_history and not recipe.logit_bias \
        and not recipe.bad_words_ids


def _chunk_scores(z: Tensor, targets: Tensor, recipe: SamplingConfig, order: Sequence[str],
                  history: TokenHistory | None) -> tuple[Tensor, Tensor, Tensor]:
    """(logp, inside, mass) of one chunk's float32 logits ``z`` [rows, V]."""
    return support_scores(penalised(z, recipe, history), targets, recipe, order)


def replay_logp(hidden: Tensor, weight: Tensor, targets: Tensor, recipe: SamplingConfig, *,
                order: Sequence[str] = TRUNCATION_ORDER, bias: Tensor | None = None,
                history: ReplayHistory | None = None,
                memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> ReplayedLogProbs:
    """Replayed log-probs of ``targets`` [N] from ``hidden`` [N, H] and the lm_head ``weight`` [V, H] (``bias`` [V]):
    the engine's ``recipe`` (a :class:`~offpolicy.rollout.sampling.SamplingConfig`) in the engine's filter ``order``
    (:data:`ENGINE_ORDERS`); ``history`` is required when the recipe has penalties. Differentiable in ``hidden``,
    ``weight`` and ``bias``; no ``[N, V]`` tensor is kept (fused kernel for temperature / min-p, else checkpointed
    row chunks within ``memory_budget_bytes``).

    >>> # h = (1, 1, 1, 1), W = diag(3, 2, 1, 0): z = (3, 2, 1, 0); top-k 2 → support {0, 1}
    >>> w = torch.diag(torch.tensor([3.0, 2.0, 1.0, 0.0])); h = torch.ones(1, 4)
    >>> r = replay_logp(h, w, torch.tensor([1]), SamplingConfig(top_k=2))
    >>> r.logp, r.inside, r.mass   # log π(1) = 2 − log(e³ + e²) = −1.3133; Z = 27.47 / (27.47 + e + 1) = 0.8808
    (tensor([-1.3133]), tensor([True]), tensor([0.8808]))
    """
    if sorted(order) != sorted(SUPPORT_ORDER):
        raise ValueError(f"order must be a permutation of {SUPPORT_ORDER}, got {tuple(order)!r}")
    vocab = weight.shape[0]
    if recipe.reads_history and history is None:
        raise ValueError(f"history: the recipe's {recipe.reads_history[0]} reads the token history; pass history=")
    if fused_recipe(recipe):
        want = ("minp_logp", "minp_mass") if recipe.min_p is not None else ("logp",)
        s = fused_token_stats(hidden, weight, targets, bias=bias, temperature=recipe.temperature, want=want,
                              min_p_rho=recipe.min_p, memory_budget_bytes=memory_budget_bytes)
        if recipe.min_p is None:
            assert s.logp is not None  # requested in want
            return ReplayedLogProbs(s.logp, torch.ones_like(targets, dtype=torch.bool), torch.ones_like(s.logp))
        assert s.minp_logp is not None and s.minp_inside is not None and s.minp_mass is not None  # requested
        return ReplayedLogProbs(s.minp_logp, s.minp_inside, s.minp_mass.detach())
    def scores(z: Tensor, a: int, b: int) -> tuple[Tensor, Tensor, Tensor]:
        hist = history.chunk(a, b, vocab) if recipe.reads_history else None  # type: ignore[union-attr]
        return _chunk_scores(z, targets[a:b], recipe, order, hist)

    # scratch per row: logits, z / T, support mask, sort values + indices, cumsum, and the history's two [rows, V]
    logp, inside, mass = head_row_map(scores, hidden, weight, bias, buffers=8, memory_budget_bytes=memory_budget_bytes)
    return ReplayedLogProbs(logp, inside, mass)
