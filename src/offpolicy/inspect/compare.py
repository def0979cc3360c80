"""Full-distribution comparison of a rollout engine and a trainer on the tokens the rollout engine sampled.

For each micro-batch of prompts: the rollout engine generates (its own path: KV cache, dtype, quantisation, noise),
and the logits it sampled from are read at every step with a forward hook on its output projection — the very tensor
generation used, not a re-computation. A check recomputes the sampled tokens' log-probs from them and requires the
engine's reported μ up to rounding (a failed check raises: the engine transforms logits in a way this module does
not replay; the tolerance is the float32 rounding of two log-softmaxes over V logits of the captured magnitude,
:func:`offpolicy.tolerances.log_softmax_tolerance`). The trainer then scores the same tokens with one full forward (optionally under autocast). At every
response position both full next-token distributions (tempered by the sampling temperature, untruncated) are compared:

* exact KL(μ‖π) (TRM's D_KL, arXiv 2512.23075), KL(π‖μ), total variation — through the chunked kernels
  (:func:`offpolicy.token_kl`, :func:`offpolicy.token_tv`);
* top-k overlap |top-k(μ) ∩ top-k(π)| / k and the rollout's top-k log-probs under both (for dumps and top-k bounds);
* vocabulary-wide |Δ_a| against p_a with DVP Prop. 4.2's envelope (:class:`~offpolicy.inspect.measurements.VocabStats`);
* DVP's min-p safe sets on a grid of ρ (:class:`~offpolicy.inspect.measurements.DvpGrid`).

Memory: a micro-batch holds ``[b, T, V]`` logits of each side; ``b`` follows from ¾ of ``memory_budget_bytes`` and
every vocabulary-wide statistic walks row chunks of it within the other ¼ (:func:`offpolicy.kernels.chunk_rows`), so
nothing ever holds the whole batch's ``[N, V]``.

An engine that exposes only top-k log-probs (vLLM, or ``rollout_view="topk"`` to see what that costs) gets the top-k
lower and upper bounds on KL(μ‖π) instead (:func:`offpolicy.topk_kl_lower_bound` / ``_upper_bound``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor

import offpolicy as op
from offpolicy.inspect.measurements import DvpGrid, Measurements, TokenData, VocabStats, pad_time
from offpolicy.inspect.routing_flips import RoutingFlips, recording_routes, route_flips
from offpolicy.inspect.specs import build_inspect_engine
from offpolicy.inspect.vocabulary import (
    DEFAULT_MEMORY_BUDGET_BYTES,
    _dvp_summary,
    dvp_check,
    dvp_grid_from_logits,
    vocabulary_stats,
)
from offpolicy.kernels import row_chunks
from offpolicy.rollout.base import RolloutOutput
from offpolicy.rollout.factory import build_engine
from offpolicy.rollout.routing import RouteRecorder
from offpolicy.rollout.sampling import SamplingConfig, process_logits
from offpolicy.rollout.scoring import score_tokens
from offpolicy.rollout.spec import EngineSpec
from offpolicy.tolerances import log_softmax_tolerance, max_abs_finite

# ρ = e^-k, k = 1 … 20: DVP's default e^-13 is on the grid, and so are the looser and stricter neighbours.
DVP_RHO_GRID: tuple[float, ...] = tuple(math.exp(-k) for k in range(1, 21))
DVP_COVERAGE = 0.999  # the recommended ρ keeps at least this much of π's mass at every position (DVP Prop. 5.5's Z)
_AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@contextlib.contextmanager
def _captured_logits(engine) -> Iterator[list[Tensor]]:
    """Every step's last-position logits [b, V] from the engine's output projection, in generation order."""
    steps: list[Tensor] = []
    head = engine.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, out: steps.append(out[:, -1].float()))
    try:
        yield steps
    finally:
        handle.remove()


def _add_engine_noise(steps: list[Tensor], sigma: float, seed: int) -> list[Tensor]:
    """Replay the HF engine's logit noise (its generator is seeded with seed + 7919 and draws one [b, V] per step);
    the capture check below fails loudly if the engine ever draws it differently."""
    if sigma <= 0:
        return steps
    gen = torch.Generator(device=steps[0].device).manual_seed(int(seed) + 7919)
    return [s + sigma * torch.randn(s.shape, generator=gen, device=s.device) for s in steps]


def micro_batch_rows(prompt_len: int, max_new_tokens: int, vocab: int, budget: int) -> int:
    """Sequences per micro-batch so that its float32 logits fit in ``budget`` bytes: the trainer's full ``[b, L, V]``
    forward output (L = prompt + T) and about six ``[b, T, V]``-sized tensors (the captured steps and their stack, the
    trainer's gathered and processed logits, both sides' valid rows).

    >>> micro_batch_rows(6, 128, 4099, 768 << 20)   # 768 MiB / (4 B · 4099 · (134 + 6·128)) = 54.4
    54
    """
    per_row = 4 * vocab * (prompt_len + max_new_tokens + 6 * max_new_tokens)
    return max(1, budget // per_row)


@dataclass
class _MicroBatch:
    """One micro-batch after generation and scoring: the sampled tokens and both sides' logits at valid positions."""

    out: RolloutOutput
    ids: Tensor  # [b, T] sampled ids (0 at padding)
    trainer_logp: Tensor  # [b, T] processed, 0 at padding
    flat_rollout: Tensor | None  # [n, V] rollout logits at the valid positions (None: top-k view)
    flat_trainer: Tensor  # [n, V]
    capture_error: float
    capture_ratio: float  # the largest capture error ÷ its tolerance (< 1: passed)
    generate_s: float
    score_s: float
    routing: RoutingFlips | None = None  # MoE: the two sides' routing flips (an engine that records routes)


def _check_capture(rollout_logits: Tensor, reported: Tensor, ids: Tensor, mask: Tensor, sampling: SamplingConfig,
                   *, first_row: int = 0) -> tuple[float, float]:
    """The replayed μ of the sampled tokens (``process_logits`` on the captured ``[b, T, V]`` logits) against the
    engine's reported ``[b, T]`` log-probs at the ``mask``'s positions: ``(max |error|, max error ÷ tolerance)``,
    the tolerance per position :func:`~offpolicy.tolerances.log_softmax_tolerance` in float32 at that row's largest
    finite |logit|. A non-finite value reported as the replay has it (an overflow) agrees. Raises ``ValueError``
    naming the worst position past its tolerance."""
    if not bool(mask.any()):
        return 0.0, 0.0
    check = process_logits(rollout_logits, sampling).gather(-1, ids[..., None]).squeeze(-1)
    got, want = check[mask], reported[mask]
    same_nonfinite = ~torch.isfinite(got) & (got == want) | (torch.isnan(got) & torch.isnan(want))
    diff = torch.where(same_nonfinite, 0.0, (got - want).double().abs())
    diff = torch.where(torch.isnan(diff), math.inf, diff)  # a NaN on one side only fails
    tol = log_softmax_tolerance(torch.float32, max_abs_finite(rollout_logits[mask]), rollout_logits.shape[-1])
    assert isinstance(tol, Tensor)  # one tolerance per position
    ratio = diff / tol
    worst = int(ratio.argmax())
    err, margin = float(diff.max()), float(ratio[worst])
    if not margin <= 1.0:
        row, pos = (int(v) for v in mask.nonzero()[worst])
        raise ValueError(
            f"the rollout logits read from the engine's output projection do not reproduce its reported log-probs: "
            f"prompt {first_row + row} position {pos} differs by {float(diff[worst]):.3g} nats, above the float32 "
            f"rounding of two log-softmaxes over {rollout_logits.shape[-1]} logits of that size ({float(tol[worst]):.3g}"
            f" nats, offpolicy.tolerances.log_softmax_tolerance): the engine changes the logits after its lm_head "
            f"(a soft-cap, a logit processor, a penalty) in a way offpolicy inspect does not replay; compare it on "
            f"its reported top-k instead (--rollout-view topk) or score its tokens in one forward (--sample-with)")
    return err, margin


def _micro_batches(roll_engine, train_engine, prompt_ids, sampling, *, view, topk, seed, rows, autocast,
                   sampler=None):
    """Generate and score ``prompt_ids`` in micro-batches of ``rows`` — deterministic, so a second pass replays the
    first exactly (the DVP check uses that when the logits do not fit in memory). With a ``sampler`` engine the tokens
    come from it and the rollout engine scores them in one full forward (``HFRolloutEngine.score``)."""
    for mb, (a, b) in enumerate(row_chunks(len(prompt_ids), rows)):
        prompts = [list(p) for p in prompt_ids[a:b]]
        mb_seed = int(seed) + mb
        t0 = time.perf_counter()
        if sampler is not None:
            sampled = sampler.generate(prompts, sampling, seed=mb_seed)
            logp, _, rollout_logits = roll_engine.score(prompts, sampled.completion_ids, sampling, return_logits=True)
            out = replace(sampled, logp=torch.where(sampled.mask, logp, 0.0))
        elif view == "full" and getattr(roll_engine, "reports_full_distribution", False):
            # a server engine (llama.cpp) returns μ over the whole vocabulary when K = V; τ · log μ are logits
            # whose tempered softmax is μ, so the rest of the comparison reads them as it reads captured logits
            vocab = train_engine.model.config.vocab_size
            out = roll_engine.generate(prompts, replace(sampling, logprobs_topk=vocab), seed=mb_seed)
            dense = torch.full((*out.mask.shape, vocab), -math.inf).scatter(-1, out.topk_ids, out.topk_logp)
            rollout_logits = sampling.temperature * dense
        elif view == "full":
            with _captured_logits(roll_engine) as steps:
                out = roll_engine.generate(prompts, sampling, seed=mb_seed)
            rollout_logits = torch.stack(_add_engine_noise(steps, roll_engine.logit_noise, mb_seed), 1)
        else:
            out = roll_engine.generate(prompts, replace(sampling, logprobs_topk=topk), seed=mb_seed)
            rollout_logits = None
        t1 = time.perf_counter()
        engine_routes = getattr(out, "routed_experts", None) if sampler is None else None
        recorder = (RouteRecorder(train_engine.model, batch_size=len(prompts)) if engine_routes is not None
                    else contextlib.nullcontext())
        with recorder:
            trainer_logp, _, trainer_logits = _score(train_engine.model, prompts, out.completion_ids, sampling,
                                                     autocast)
        t2 = time.perf_counter()
        mask = out.mask
        routing = None
        if isinstance(recorder, RouteRecorder) and engine_routes is not None:
            # the trainer's routes at the positions the engine forwarded (P + C − 1 per row, rows from position 0)
            lengths = [len(p) + len(c) - 1 for p, c in zip(prompts, out.completion_ids)]
            routing = RoutingFlips.from_rows(route_flips(engine_routes, recorder.pop_rows(lengths)),
                                             [len(p) for p in prompts], [len(c) for c in out.completion_ids],
                                             mask.shape[1])
        ids = torch.tensor([c + [0] * (mask.shape[1] - len(c)) for c in out.completion_ids],
                           dtype=torch.long).reshape(mask.shape)
        err = margin = 0.0
        if rollout_logits is not None and sampler is None:
            err, margin = _check_capture(rollout_logits, out.logp, ids, mask, sampling, first_row=a)
        yield _MicroBatch(out=out, ids=ids, trainer_logp=torch.where(mask, trainer_logp, 0.0),
                          flat_rollout=None if rollout_logits is None else rollout_logits[mask],
                          flat_trainer=trainer_logits[mask], capture_error=err, capture_ratio=margin,
                          generate_s=t1 - t0, score_s=t2 - t1, routing=routing)


def compare_engines(model: torch.nn.Module, prompt_ids: list[list[int]], rollout: EngineSpec, trainer: EngineSpec,
                    sampling: SamplingConfig, *, tokenizer=None, seed: int = 0, ignore_eos: bool = False,
                    topk: int = 20, rollout_view: str = "full", dvp_rhos: tuple[float, ...] | None = DVP_RHO_GRID,
                    dvp_coverage: float = DVP_COVERAGE, memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
                    model_path: str | None = None, engines: tuple | None = None,
                    sample_with: EngineSpec | None = None) -> Measurements:
    """Sample with ``rollout``, score with ``trainer``, compare at every response position (module docstring).

    ``prompt_ids``: token-id lists; ``sampling``: the rollout's sampling (``max_new_tokens``, temperature, truncation);
    ``ignore_eos``: generate exactly ``max_new_tokens`` per prompt; ``topk``: width of the top-k overlap and of the
    stored top-k log-probs; ``rollout_view``: "full" (the engine's logits) or "topk" (only its top-k log-probs, as vLLM
    reports; forced for ``backend="vllm"``); ``dvp_rhos``: DVP's ρ grid (None or empty skips DVP) and
    ``dvp_coverage`` the retained mass the recommended ρ must keep at every position; that ρ is then re-checked with
    :func:`offpolicy.constrained_logp` on the same logits (kept in memory when the prompts fit in one micro-batch or
    the logits in ¼ of ``memory_budget_bytes``, else regenerated: generation is deterministic). ``model_path``: the
    local directory a vLLM engine loads; ``engines``: already-built ``(rollout_engine, trainer_engine)`` to reuse.

    ``sample_with``: take the tokens from this engine instead, and let the rollout engine score them in one full
    forward (its dtype, quantisation and KV quantisation replayed; not its logit noise, nor its KV-cache summation
    order, which is exact in bf16 and differs by ~1e-4 nats in fp16). Several rollout specs inspected with the same
    ``sample_with`` are compared on identical token sequences — a paired comparison, where each engine's own samples
    would add their sampling noise to the difference.

    Returns :class:`Measurements` without ``layers`` (:func:`offpolicy.inspect.layers.layer_errors` adds them).
    """
    from offpolicy.inspect.recommend import choose_dvp_rho

    if rollout_view not in ("full", "topk"):
        raise ValueError(f"rollout_view must be 'full' or 'topk', got {rollout_view!r}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be an int ≥ 1, got {topk!r}")
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one prompt")
    if sampling.reads_history:
        raise ValueError("sampling: penalties (repetition / frequency / presence) and multi-token bad words depend on "
                         "each row's token history, which offpolicy inspect does not replay; inspect without them")
    if not (isinstance(dvp_coverage, (int, float)) and 0 < dvp_coverage <= 1):
        raise ValueError(f"dvp_coverage must be in (0, 1], got {dvp_coverage!r}")
    if sample_with is not None and (rollout_view != "full" or rollout.logit_noise or sample_with.backend != "hf"
                                    or rollout.backend != "hf"):
        raise ValueError("sample_with needs a transformers rollout engine with full logits and no logit noise (a "
                         "full forward cannot replay the noise), and a transformers sampler")
    roll_engine, train_engine = engines or (
        _rollout_engine(model, recording_routes(model, rollout), tokenizer, model_path, topk,
                        full=rollout_view == "full"),
        build_inspect_engine(model, trainer))
    # an engine outside this process (vLLM, a server) shows its full distribution only where it returns K = V
    full_capable = rollout.backend in ("hf", "llamacpp") or getattr(roll_engine, "reports_full_distribution", False)
    view = rollout_view if full_capable else "topk"
    truncated = sampling.top_k is not None or sampling.top_p is not None or sampling.min_p is not None
    if (view == "topk" or rollout.backend != "hf") and truncated:
        raise ValueError("a comparison against a real engine's reported log-probs needs untruncated sampling (top_k, "
                         "top_p, min_p unset): it reads the rollout's log-probs against the trainer's full tempered "
                         "distribution")
    if ignore_eos:
        protocol = getattr(roll_engine, "protocol", None)
        if rollout.backend == "hf":
            roll_engine.eos_token_id = None  # a model without eos runs to max_new_tokens (HF engine contract)
        elif rollout.backend == "vllm":
            setattr(roll_engine, "ignore_eos", True)  # noqa: B010 - vLLM's SamplingParams.ignore_eos
        elif rollout.backend in ("llamacpp", "server") and protocol is not None and hasattr(protocol, "ignore_eos"):
            protocol.ignore_eos = True  # llama-server bans end-of-generation tokens; vLLM's server takes ignore_eos
        else:
            raise ValueError("ignore_eos is implemented for the transformers, vLLM and llama.cpp engines only")
    model_config: Any = model.config  # a transformers config (torch types module attributes as Tensor | Module)
    vocab = model_config.vocab_size
    t_max = sampling.max_new_tokens
    # ¾ of the budget for the micro-batch's logits, ¼ for the chunked kernels' scratch
    rows = micro_batch_rows(max(len(p) for p in prompt_ids), t_max, vocab, memory_budget_bytes * 3 // 4)
    scratch = max(1 << 20, memory_budget_bytes // 4)
    autocast = _AUTOCAST.get(trainer.autocast) if trainer.autocast else None
    tau = sampling.temperature
    rhos = tuple(dvp_rhos or ())
    gen = torch.Generator().manual_seed(int(seed) + 1)
    sampler = None
    if sample_with is not None:
        sampler = build_inspect_engine(model, sample_with, tokenizer)
        if ignore_eos:
            sampler.eos_token_id = None
    batches = partial(_micro_batches, roll_engine, train_engine, prompt_ids, sampling, view=view, topk=topk,
                      seed=seed, rows=rows, autocast=autocast, sampler=sampler)
    parts: dict[str, list[Tensor]] = {}
    vocab_stats = VocabStats() if view == "full" else None
    kept: list[tuple[Tensor | None, Tensor, Tensor]] | None = []  # the logits for the DVP check, while they fit
    kept_bytes = 0
    timings = {"generate_s": 0.0, "score_s": 0.0, "compare_s": 0.0, "dvp_check_s": 0.0}
    capture_error = capture_ratio = 0.0
    flips: list[RoutingFlips] = []
    for mb in batches():
        t0 = time.perf_counter()
        per_pos, stats = _position_stats(mb, tau=tau, topk=topk, rhos=rhos, generator=gen, scratch=scratch)
        if stats is not None:
            assert vocab_stats is not None  # both exist in the full view only
            vocab_stats = vocab_stats.merge(stats)
        if rhos and kept is not None:
            flat_r, flat_t = mb.flat_rollout, mb.flat_trainer
            kept_bytes += (flat_t.numel() + (0 if flat_r is None else flat_r.numel())) * 4
            # one micro-batch: its own logits, no extra memory; several: keep them while they fit in ¼ of the budget
            fits = rows >= len(prompt_ids) or kept_bytes <= memory_budget_bytes // 4
            kept = kept + [(flat_r, flat_t, mb.ids[mb.out.mask])] if fits else None
        timings["generate_s"] += mb.generate_s
        timings["score_s"] += mb.score_s
        timings["compare_s"] += time.perf_counter() - t0
        capture_error = max(capture_error, mb.capture_error)
        capture_ratio = max(capture_ratio, mb.capture_ratio)
        _collect(parts, mb, per_pos, t_max)
        if mb.routing is not None:
            flips.append(mb.routing)
    cat = {name: torch.cat(p) for name, p in parts.items()}
    tokens = _token_data(cat, kl_kind="exact" if view == "full" else "topk", prompt_ids=prompt_ids)
    routing = RoutingFlips.concat(flips, t_max) if flips else None
    grid = None
    if rhos:
        grid = DvpGrid(rhos=list(rhos), mass=cat["dvp_mass"], inside_trainer=cat["dvp_inside_trainer"],
                       inside_rollout=cat.get("dvp_inside_rollout"))
        choice = choose_dvp_rho(grid, coverage=dvp_coverage)
        t0 = time.perf_counter()
        again = kept if kept is not None else ((m.flat_rollout, m.flat_trainer, m.ids[m.out.mask]) for m in batches())
        checks = [dvp_check(r, t, y, choice["rho"], temperature=tau, memory_budget_bytes=scratch)
                  for r, t, y in again]
        timings["dvp_check_s"] = time.perf_counter() - t0
        grid.check = _dvp_summary(choice, checks, dvp_coverage)
    meta = {
        "rollout": rollout.as_dict() | {"description": rollout.describe()},
        "trainer": trainer.as_dict() | {"description": trainer.describe()},
        "sampling": {**sampling.__dict__, "ignore_eos": bool(ignore_eos)},
        "seed": int(seed), "topk": topk, "rollout_view": view,
        "sampled_with": None if sample_with is None else sample_with.as_dict() | {"description": sample_with.describe()},
        "prompts": len(prompt_ids), "positions": int(tokens.mask.sum()), "vocab_size": vocab,
        "micro_batch_rows": rows,
        "capture_max_abs_error": capture_error if view == "full" and sampler is None else None,
        "capture_error_over_tolerance": capture_ratio if view == "full" and sampler is None else None,
        "timings": timings,
    }
    return Measurements(tokens=tokens, vocab=vocab_stats, dvp=grid, meta=meta, routing=routing)


def _position_stats(mb: _MicroBatch, *, tau: float, topk: int, rhos: tuple[float, ...],
                    generator: torch.Generator, scratch: int) -> tuple[dict[str, Tensor], VocabStats | None]:
    """Per-position statistics ``{name: [n, …]}`` of one micro-batch's valid positions, and its vocabulary aggregates
    (None in the top-k view, where only the rollout's top-k is known)."""
    mask, flat_t, flat_r = mb.out.mask, mb.flat_trainer, mb.flat_rollout
    targets = mb.ids[mask]
    per_pos: dict[str, Tensor] = {}
    if flat_r is not None:
        kw: dict[str, Any] = {"temperature": tau, "rollout_temperature": tau, "memory_budget_bytes": scratch}
        per_pos["kl"] = op.token_kl(flat_r, flat_t, **kw)
        per_pos["kl_reverse"] = op.token_kl(flat_t, flat_r, **kw)
        per_pos["tv"] = op.token_tv(flat_r, flat_t, **kw)
        stats, extras = vocabulary_stats(flat_r, flat_t, temperature=tau, topk=topk, dvp_rhos=rhos, targets=targets,
                                         generator=generator, memory_budget_bytes=scratch)
        per_pos.update(extras)
        return per_pos, stats
    assert mb.out.topk_logp is not None and mb.out.topk_ids is not None  # the top-k view
    r_lp, r_ids = mb.out.topk_logp[mask], mb.out.topk_ids[mask]
    kw = {"temperature": tau, "memory_budget_bytes": scratch}
    per_pos["kl"], per_pos["tv"] = op.topk_kl_lower_bound(r_lp, r_ids, flat_t, with_tv=True, **kw)
    per_pos["kl_upper"] = op.topk_kl_upper_bound(r_lp, r_ids, flat_t, **kw)
    per_pos["topk_ids"], per_pos["rollout_topk_logp"] = r_ids, r_lp
    per_pos["trainer_topk_logp"] = (flat_t.double() / tau).log_softmax(-1).gather(1, r_ids).float()
    if rhos:
        per_pos.update(dvp_grid_from_logits(flat_t, targets, rhos, temperature=tau))
    return per_pos, None


def _collect(parts: dict[str, list[Tensor]], mb: _MicroBatch, per_pos: dict[str, Tensor], t_max: int) -> None:
    """Append one micro-batch: DVP columns ``[n, G]`` as they are, the rest scattered back into ``[b, T_max(, K)]``."""
    mask = mb.out.mask
    for name, flat in per_pos.items():
        if name.startswith("dvp_"):
            parts.setdefault(name, []).append(flat)
            continue
        full = torch.zeros((*mask.shape, *flat.shape[1:]), dtype=flat.dtype)
        full[mask] = flat.detach().to(full.dtype)
        parts.setdefault(name, []).append(pad_time(full, t_max))
    parts.setdefault("mask", []).append(pad_time(mask, t_max, False))
    parts.setdefault("ids", []).append(pad_time(mb.ids, t_max))
    parts.setdefault("rollout_logp", []).append(pad_time(mb.out.logp, t_max))
    parts.setdefault("trainer_logp", []).append(pad_time(mb.trainer_logp, t_max))


_OPTIONAL_TOKEN_FIELDS = ("kl", "kl_upper", "kl_reverse", "tv", "topk_overlap", "eps_max", "topk_ids",
                          "rollout_topk_logp", "trainer_topk_logp")


def _token_data(cat: dict[str, Tensor], *, kl_kind: str, prompt_ids: list[list[int]]) -> TokenData:
    """The concatenated micro-batches as :class:`TokenData`, without the all-padding columns at the end."""
    t = max(1, int(cat["mask"].sum(-1).max()))
    return TokenData(
        completion_ids=cat["ids"][:, :t], mask=cat["mask"][:, :t], rollout_logp=cat["rollout_logp"][:, :t],
        trainer_logp=cat["trainer_logp"][:, :t], kl_kind=kl_kind, prompt_ids=[list(p) for p in prompt_ids],
        **{name: cat[name][:, :t] if name in cat else None for name in _OPTIONAL_TOKEN_FIELDS},
    )


def _score(model, prompts, completions, sampling, autocast):
    """The trainer's processed log-probs and raw logits [b, T, V] of the sampled tokens (one full forward)."""
    with torch.no_grad():
        return score_tokens(model, prompts, completions, sampling, dtype=autocast, return_logits=True)


def _rollout_engine(model, spec: EngineSpec, tokenizer, model_path: str | None, topk: int, *, full: bool = True):
    """The rollout side's engine, from the factory (:func:`offpolicy.rollout.build_engine`): vLLM reports the full
    distribution at every sampled position when asked for (``max_logprobs=-1``), else its top-k log-probs; a vLLM
    server is probed for K = V log-probs (:func:`_probe_full_distribution`)."""
    if spec.backend == "vllm":
        unsupported = [name for name in ("kv_cache_bits", "weight_bits", "quantize_layers") if getattr(spec, name)]
        if spec.lm_head_fp32 or spec.logit_noise or unsupported or not spec.kv_cache:
            raise ValueError("--rollout backend=vllm takes dtype and kv_cache_dtype only (vLLM's own settings); the "
                             "simulated knobs are for the transformers engine")
        spec = replace(spec, max_logprobs=-1 if full else topk)
    try:
        engine = build_engine(spec, model=model, tokenizer=tokenizer, model_path=model_path)
    except ImportError as err:  # no vLLM / xllamacpp: one line, as for any other bad setting
        raise ValueError(f"--rollout backend={spec.backend}: {err}") from None
    if spec.backend == "server":
        _probe_full_distribution(engine)
    return engine


def _probe_full_distribution(engine) -> None:
    """Whether a vLLM server returns K = V log-probs (started with ``--max-logprobs -1``): then it reports the full
    distribution; else (it caps K) the comparison falls back to top-k bounds."""
    from offpolicy.rollout.http import ServerError, post_json
    from offpolicy.rollout.protocols import VLLMProtocol

    if not isinstance(engine.protocol, VLLMProtocol):
        return
    vocab = engine.vocab_size
    body = {"model": engine.protocol.model, "prompt": [0], "max_tokens": 1, "logprobs": vocab, "temperature": 1.0}
    try:
        post_json(engine.url + "/v1/completions", body, timeout=engine.timeout, what="vLLM full-vocabulary probe")
        engine.reports_full_distribution = True
    except ServerError:  # the server caps K (--max-logprobs): top-k bounds instead
        engine.reports_full_distribution = False
