"""The asynchronous trainers' data in the reference trainer: a staleness-bounded queue and partial rollouts.

``rollout.sync_every = k`` (the lab's ``lagK``) is an engine that lags as a whole: every sample of a step comes from
the same old weights. Asynchronous trainers produce data differently, and ``rollout.async_mode`` reproduces it with
the trainer's own weight history (the last ``max_staleness + 1`` versions, kept as CPU copies):

* ``queue`` (TRL's ``AsyncGRPOTrainer``: a generation worker fills a queue, the trainer consumes it and drops a
  sample more than ``max_staleness`` = K versions old, ``RolloutQueueDataset``): each group of the batch at trainer
  version v (the steps done) was generated with the weights of version v − d, its *latency* d drawn uniformly from
  0 … K + 1 (seeded per step). A group with staleness d > K is dropped, as TRL drops it, and the trainer pulls the
  next one; at the start of a run no version older than 0 exists, so v − d is clipped at 0 (staleness v, never
  dropped). One batch so mixes staleness 0 … K, group by group (:func:`queue_versions`).
* ``partial`` (verl's fully asynchronous trainer with partial rollouts: a generation interrupted by a weight sync
  resumes under the new weights, its tokens recording ``min_global_steps`` / ``max_global_steps``): each answer is
  generated in K segments of S = ⌈max_new_tokens / K⌉ tokens, segment i with version v − (K − 1) + i (clipped at 0),
  the engine re-reading the answer so far under the new weights at each switch, as an aborted and resumed request
  is re-prefilled. An answer thus spans up to K versions — its first tokens K − 1 steps stale, its last fresh — and
  one that ends (eos) before a switch never sees the later weights (:func:`partial_versions`).

Both give every sampled token its version (``Rollout.versions`` ``[B, T]``, −1 on padding), which the trainer
carries into every minibatch's :class:`~offpolicy.LogProbBatch` (``versions``, ``policy_version``): decoupled PPO's
log-linear π_prox (:mod:`offpolicy.train.proximal`) reads it per token; μ itself is each token's own version's
log-prob, so the recomputed π_prox and the corrections see per-token staleness through π_old / μ. The trainer logs
``staleness/mean`` and ``staleness/max`` over the valid tokens (v − version), ``staleness/dropped`` (groups the queue
dropped this step), ``staleness/versions_per_answer`` (mean of max − min + 1 over rows, verl's partial span + 1)
and, per staleness d, the mismatch and the correction's clipped / masked shares (``staleness/d<d>/*``).

A stylised model, not a simulated generator: the queue's latencies are i.i.d. draws, not the lengths of earlier
answers. The weight history is saved in checkpoints, so a resumed run samples from the same old weights.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:  # offpolicy.train.steps imports this module
    from offpolicy.train.steps import TrainState


# -- the schedules (pure) -----------------------------------------------------------------------------------------------


def queue_versions(version: int, groups: int, max_staleness: int, latencies: Iterable[int]) -> tuple[list[int], int]:
    """The weights version each of ``groups`` groups was generated with, and how many groups were dropped, for the
    batch at trainer version ``version``: each pulled latency d gives version max(0, version − d); a group more
    than ``max_staleness`` versions old is dropped and the next one pulled (TRL's rule).

    >>> queue_versions(5, 3, 2, [0, 3, 2, 1])  # the group of latency 3 (staleness 3 > 2) is dropped
    ([5, 3, 4], 1)
    >>> queue_versions(1, 2, 2, [3, 0])  # at version 1 nothing older than 0 exists: staleness 1, kept
    ([0, 1], 0)
    """
    if max_staleness < 0:
        raise ValueError(f"rollout.max_staleness must be >= 0, got {max_staleness}")
    pulled: Iterator[int] = iter(latencies)
    out: list[int] = []
    dropped = 0
    while len(out) < groups:
        try:
            d = next(pulled)
        except StopIteration:
            raise ValueError(f"latencies ran out after {len(out)} of {groups} groups ({dropped} dropped)") from None
        v = max(0, version - int(d))
        if version - v > max_staleness:
            dropped += 1
            continue
        out.append(v)
    return out, dropped


def seeded_latencies(seed: int, max_staleness: int) -> Iterator[int]:
    """Latencies uniform on 0 … ``max_staleness`` + 1, drawn in blocks from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield from torch.randint(0, max_staleness + 2, (64,), generator=g).tolist()


def segment_length(max_new_tokens: int, versions: int) -> int:
    """S = ⌈max_new_tokens / K⌉, the tokens each of a partial rollout's K versions generates.

    >>> segment_length(32, 4), segment_length(10, 4)
    (8, 3)
    """
    if versions < 1 or versions > max_new_tokens:
        raise ValueError(f"rollout.max_staleness={versions}: a partial rollout needs 1 <= K <= "
                         f"rollout.sampling.max_new_tokens={max_new_tokens} versions per answer")
    return math.ceil(max_new_tokens / versions)


def segment_versions(version: int, versions: int) -> list[int]:
    """The weights version of each of the K segments of an answer at trainer version ``version``.

    >>> segment_versions(5, 3), segment_versions(1, 3)
    ([3, 4, 5], [0, 0, 1])
    """
    return [max(0, version - (versions - 1) + i) for i in range(versions)]


def partial_versions(lengths: list[int], version: int, versions: int, max_new_tokens: int) -> Tensor:
    """``[B, T]`` int64 (T = the longest answer): the version of each token of answers of ``lengths`` tokens, token
    t in segment ⌊t / S⌋; −1 on padding.

    >>> partial_versions([5, 2], 5, 3, 6)  # S = 2: tokens 0–1 version 3, 2–3 version 4, 4–5 version 5
    tensor([[ 3,  3,  4,  4,  5],
            [ 3,  3, -1, -1, -1]])
    """
    s = segment_length(max_new_tokens, versions)
    per_segment = torch.tensor(segment_versions(version, versions), dtype=torch.long)
    t = max(lengths, default=0)
    positions = torch.arange(t)
    by_position = per_segment[(positions // s).clamp(max=versions - 1)]
    valid = positions[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]
    return torch.where(valid, by_position[None, :].expand(len(lengths), t), -1)


def sequence_versions(versions: Tensor) -> Tensor:
    """Each answer's oldest version on all its tokens (−1 kept on padding): the per-token versions as a host that
    records one version per trajectory gives them (verl's ``min_global_steps``).

    >>> sequence_versions(torch.tensor([[3, 3, 4, 5], [4, 5, -1, -1], [-1, -1, -1, -1]]))
    tensor([[ 3,  3,  3,  3],
            [ 4,  4, -1, -1],
            [-1, -1, -1, -1]])
    """
    valid = versions >= 0
    oldest = torch.where(valid, versions, torch.iinfo(versions.dtype).max).amin(dim=1, keepdim=True)
    return torch.where(valid, oldest.expand_as(versions), versions)


def staleness_metrics(versions: Tensor, version: int) -> dict[str, Tensor]:
    """``staleness/mean`` and ``staleness/max`` over the valid tokens (``versions`` ≥ 0) of ``version − versions``,
    and ``staleness/versions_per_answer``: the rows' mean of max − min + 1 (1: one version per answer).

    >>> m = staleness_metrics(torch.tensor([[3, 3, 4, -1], [5, 5, -1, -1]]), 5)
    >>> [round(float(m[k]), 3) for k in ("staleness/mean", "staleness/max", "staleness/versions_per_answer")]
    [1.0, 2.0, 1.5]
    """
    valid = versions >= 0
    stale = (version - versions).double()
    n = valid.sum().clamp(min=1)
    mean = torch.where(valid, stale, 0.0).sum() / n
    worst = torch.where(valid, stale, -math.inf).max() if bool(valid.any()) else torch.zeros((), dtype=torch.double)
    rows = valid.any(-1)
    big = torch.iinfo(torch.long).max
    span = (torch.where(valid, versions, -1).max(-1).values - torch.where(valid, versions, big).min(-1).values + 1)
    per_answer = span[rows].double().mean() if bool(rows.any()) else torch.zeros((), dtype=torch.double)
    return {"staleness/mean": mean, "staleness/max": worst, "staleness/versions_per_answer": per_answer}


# -- the weight history -------------------------------------------------------------------------------------------------


class WeightHistory(torch.nn.Module):
    """The trainer's weights at the last ``keep`` versions, a ring of buffers (slot = version mod ``keep``, so a
    checkpoint holds them and a resumed run samples from the same old weights), and a scratch copy of the model that
    the engine syncs from, so that the engine samples with any of them in its own numerics (cast, quantised)."""

    versions: Tensor  # [keep] int64 buffer: the version in each slot, −1 when empty

    def __init__(self, model: torch.nn.Module, keep: int):
        super().__init__()
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._keys = list(model.state_dict())
        for slot in range(keep):
            for j, value in enumerate(model.state_dict().values()):
                self.register_buffer(f"slot{slot}_{j}", torch.zeros_like(value, device="cpu"))
        self.register_buffer("versions", torch.full((keep,), -1, dtype=torch.long))  # −1: an empty slot
        self._scratch = (copy.deepcopy(model).requires_grad_(False),)  # a tuple: not a submodule, not saved

    def held(self) -> list[int]:
        """The versions held, oldest first."""
        return sorted(int(v) for v in self.versions if v >= 0)

    def record(self, version: int, model: torch.nn.Module) -> None:
        """Keep ``model``'s weights as ``version`` (replacing the version ``keep`` older in its slot)."""
        slot = version % self.keep
        if int(self.versions[slot]) == version:
            return
        with torch.no_grad():
            for j, value in enumerate(model.state_dict().values()):
                self._slot(slot, j).copy_(value.detach())
        self.versions[slot] = version

    def sync(self, engine: Any, version: int) -> int:
        """Push version ``version``'s weights into ``engine`` (the newest older one held when it is not; the oldest
        held when none is older); returns the version pushed."""
        held = self.held()
        if not held:
            raise ValueError("the weight history is empty: record() a version before sync()")
        use = max([v for v in held if v <= version] or [held[0]])
        slot = use % self.keep
        scratch = self._scratch[0]
        scratch.load_state_dict({key: self._slot(slot, j) for j, key in enumerate(self._keys)})
        engine.sync_weights(scratch)
        return use

    @property
    def scratch(self) -> torch.nn.Module:
        return self._scratch[0]

    def _slot(self, slot: int, j: int) -> Tensor:
        buffer = getattr(self, f"slot{slot}_{j}")
        assert isinstance(buffer, Tensor)
        return buffer


# -- generation --------------------------------------------------------------------------------------------------------


@dataclass
class Generated:
    """What an asynchronous rollout's engine calls produced, row by row in the batch's order."""

    completions: list[list[int]]
    logp: Tensor  # [B, T] float32, 0 on padding
    versions: Tensor  # [B, T] int64, −1 on padding
    texts: list[str]
    dropped: int = 0


def _pad(rows: list[Tensor], value: float | int, dtype: torch.dtype) -> Tensor:
    t = max((r.numel() for r in rows), default=0)
    out = torch.full((len(rows), t), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r.to(dtype)
    return out


def _call_seed(seed: int, version: int, part: int) -> int:
    """A distinct seed per engine call of one step (each version's call, each segment)."""
    return (seed + 104_729 * (version + 1) + 7_919 * part) % (2**62)


def queue_generate(state: TrainState, prompt_ids: list[list[int]], group_size: int, seed: int) -> Generated:
    """The step's groups, each generated with the version :func:`queue_versions` gives it (one engine call per
    version); μ of every token is its own version's."""
    k = state.cfg.rollout.max_staleness
    groups = len(prompt_ids) // group_size
    group_versions, dropped = queue_versions(state.policy_version, groups, k, seeded_latencies(seed, k))
    row_versions = [v for v in group_versions for _ in range(group_size)]
    completions: list[list[int]] = [[] for _ in prompt_ids]
    logp_rows: list[Tensor] = [torch.zeros(0) for _ in prompt_ids]
    texts = [""] * len(prompt_ids)
    history = _history(state)
    for v in sorted(set(row_versions)):
        rows = [i for i, rv in enumerate(row_versions) if rv == v]
        history.sync(state.engine, v)
        out = state.engine.generate([prompt_ids[i] for i in rows], state.sampling, seed=_call_seed(seed, v, 0))
        for j, i in enumerate(rows):
            completions[i] = list(out.completion_ids[j])
            logp_rows[i] = out.logp[j, : len(completions[i])].float().cpu()
            texts[i] = (out.texts or [""] * len(rows))[j]
    versions = _pad([torch.full((len(c),), v, dtype=torch.long) for c, v in zip(completions, row_versions)], -1,
                    torch.long)
    return Generated(completions, _pad(logp_rows, 0.0, torch.float32), versions, texts, dropped)


def partial_generate(state: TrainState, prompt_ids: list[list[int]], seed: int) -> Generated:
    """Every answer generated in K segments, segment i with :func:`segment_versions`' version i; the engine reads
    the prompt and the answer so far as its prompt at each switch (a resumed request re-prefilled)."""
    k = state.cfg.rollout.max_staleness
    sampling = state.sampling
    s = segment_length(sampling.max_new_tokens, k)
    eos = getattr(state.tokenizer, "eos_token_id", None)
    completions: list[list[int]] = [[] for _ in prompt_ids]
    logps: list[list[Tensor]] = [[] for _ in prompt_ids]
    tags: list[list[Tensor]] = [[] for _ in prompt_ids]
    active = list(range(len(prompt_ids)))
    history = _history(state)
    for i, v in enumerate(segment_versions(state.policy_version, k)):
        budget = min(s, sampling.max_new_tokens - i * s)
        if not active or budget <= 0:
            break
        history.sync(state.engine, v)
        out = state.engine.generate([prompt_ids[r] + completions[r] for r in active], replace(sampling, max_new_tokens=budget),
                                    seed=_call_seed(seed, v, i))
        still = []
        for j, r in enumerate(active):
            ids = list(out.completion_ids[j])
            completions[r].extend(ids)
            logps[r].append(out.logp[j, : len(ids)].float().cpu())
            tags[r].append(torch.full((len(ids),), v, dtype=torch.long))
            if len(ids) == budget and not (eos is not None and ids and ids[-1] == eos):
                still.append(r)  # not finished: it resumes under the next version
        active = still
    texts = _decode(state.tokenizer, completions)
    versions = _pad([torch.cat(x) if x else torch.zeros(0, dtype=torch.long) for x in tags], -1, torch.long)
    if state.cfg.rollout.version_record == "sequence":
        versions = sequence_versions(versions)
    return Generated(completions, _pad([torch.cat(x) if x else torch.zeros(0) for x in logps], 0.0, torch.float32),
                     versions, texts)


def _decode(tokenizer: Any, completions: list[list[int]]) -> list[str]:
    if tokenizer is None or not hasattr(tokenizer, "decode"):
        return [""] * len(completions)
    return [tokenizer.decode(c, skip_special_tokens=True) for c in completions]


def _history(state: TrainState) -> WeightHistory:
    """The state's weight history, with the trainer's current weights recorded as the current version."""
    if state.weight_history is None:
        state.weight_history = WeightHistory(state.model, keep=state.cfg.rollout.max_staleness + 1)
    state.weight_history.record(state.policy_version, state.model)
    return state.weight_history


def check_async(cfg: Any, engine: Any) -> None:
    """Refuse an asynchronous mode the trainer cannot run (a ``ValueError`` naming the setting)."""
    r = cfg.rollout
    if r.async_mode == "none":
        if r.version_record != "token":
            raise ValueError(f"rollout.version_record={r.version_record} applies to an asynchronous rollout; "
                             "rollout.async_mode is none")
        return
    if r.max_staleness < 1:
        raise ValueError(f"rollout.async_mode={r.async_mode}: rollout.max_staleness must be >= 1, got {r.max_staleness}")
    if r.sync_every != 1:
        raise ValueError(f"rollout.async_mode={r.async_mode} sets which weights each sample uses; rollout.sync_every "
                         f"must be 1, got {r.sync_every}")
    if r.routing_replay != "none":
        raise ValueError(f"rollout.async_mode={r.async_mode} cannot replay routes (rollout.routing_replay="
                         f"{r.routing_replay}): its rows come from several engine calls")
    if not callable(getattr(engine, "sync_weights", None)):
        raise ValueError(f"rollout.async_mode={r.async_mode} needs an engine with sync_weights(model)")
    if r.async_mode == "partial":
        segment_length(r.sampling.max_new_tokens, r.max_staleness)
