"""Routing replay for mixture-of-experts models: record the experts each token was routed to, replay them elsewhere.

A MoE router picks the top-k experts of each token. A tiny numerical difference between the rollout engine and the
trainer (bf16 vs fp32, another kernel) can swap an expert at a near-tie, and a swapped expert changes the token's
hidden state — a routing flip turns jitter into a large probability change (arXiv 2512.23075 names it among the
mismatch sources). Routing replay removes it by making the trainer's forward use recorded routes:

* **R3**, rollout routing replay (arXiv 2510.11370): the rollout engine records the routes it used for every
  prompt and completion position; the trainer replays them in its π_old and π_θ forwards.
* **R2**, routing replay (GSPO, arXiv 2507.18071 §5): the trainer's π_old forward routes natively and records; the
  π_θ forwards of the update replay π_old's routes, so the ratio π_θ/π_old is not moved by routing changes while
  the policy is updated. The engine's routes are not used.

(verl's ``router_replay.mode: R2 | R3`` means the same.) What is replayed is the *selection* only: the gate weights
are recomputed from the trainer's own router logits at the replayed experts — softmax over all experts, gathered at
the replayed ones, renormalised where the model renormalises — so the router still gets its gradient (as the R3
paper and verl's Megatron router-replay patch do).

Supported: Hugging Face MoE routers whose forward maps hidden states ``[N, H]`` to ``(router_logits [N, E],
weights [N, k], experts [N, k])`` as softmax → top-k → optional renormalisation — in transformers 5.x the
``*TopKRouter`` modules of Qwen2-MoE, Qwen3-MoE, Mixtral and OLMoE, among others. Each router's gate computation is
checked on its first call (recomputing the native routes must give the native weights); a router computed another
way (sigmoid scores, grouped or biased top-k) is refused with a ``ValueError`` naming its class.

Routes are stored per sequence as an integer tensor ``[P + C − 1, L, k]``: the experts of each of the L MoE layers
(in module order) for every position the engine forwarded — the prompt and all completion tokens but the last,
which is sampled and never fed back (vLLM's ``routed_experts`` uses the same positions). Replay lines them up with a
right-padded forward whose rows start at position 0 (:func:`offpolicy.rollout.scoring.sequence_logprobs`);
positions without a recorded route (the last token, padding) route natively.

>>> import torch
>>> from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
>>> torch.manual_seed(0) and None
>>> model = Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
...     moe_intermediate_size=8, shared_expert_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
...     num_key_value_heads=1, num_experts=4, num_experts_per_tok=2))
>>> ids = torch.tensor([[1, 5, 7, 9]])
>>> with RouteRecorder(model, batch_size=1) as rec:
...     native = model(input_ids=ids).logits
>>> routes = rec.pop()                     # [B, S, L, k]
>>> routes.shape
torch.Size([1, 4, 2, 2])
>>> with replay_routes(model, [routes[0, :3]]) as replay:    # the first P + C − 1 = 3 positions
...     replayed = model(input_ids=ids).logits
>>> torch.equal(native, replayed), replay.flip_rate
(True, 0.0)
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from offpolicy.tolerances import eps, log_softmax_tolerance, max_abs_finite, rounding_tolerance


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in module order (one per MoE layer); ``ValueError`` if it has none.

    A router is a module whose class name ends in ``TopKRouter`` (transformers 5.x: ``Qwen2MoeTopKRouter``,
    ``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ``OlmoeTopKRouter``, …) with a ``top_k``.
    """
    routers = [m for m in model.modules() if _is_router(m)]
    if not routers:
        raise ValueError(
            f"{type(model).__name__} has no mixture-of-experts router (a *TopKRouter module): routing replay needs "
            "an MoE model such as Qwen2-MoE, Qwen3-MoE, Mixtral or OLMoE"
        )
    return routers


def _is_router(module: nn.Module) -> bool:
    return type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k")


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` has mixture-of-experts routers that routing replay handles (:func:`find_routers`)."""
    return any(_is_router(m) for m in model.modules())


def route_dtype(num_experts: int) -> torch.dtype:
    """Integer dtype for stored expert ids: int16 where it fits (as vLLM returns them), else int32."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


def _num_experts(router: nn.Module) -> int:
    return int(getattr(router, "num_experts", None) or router.get_parameter("weight").shape[0])


class _RouterHooks:
    """A forward hook from ``self._hook(position)`` on each of ``self.routers`` while the context is open."""

    routers: list[nn.Module]
    _handles: list

    def _hook(self, position: int):  # noqa: ANN202  (returns a forward hook)
        raise NotImplementedError

    def __enter__(self):  # noqa: ANN204
        for position, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(position)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class RouteRecorder(_RouterHooks):
    """Context manager that records the experts every router picks, per forward.

    ``batch_size`` is the B of the forwards (each router sees its input flattened to ``[B·S, H]``). After each
    forward, :meth:`pop` returns its routes ``[B, S, L, k]`` (int16/int32; L routers in module order) and clears them.

    >>> # see the module docstring for a full example
    """

    def __init__(self, model: nn.Module, *, batch_size: int) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.routers = find_routers(model)
        self.batch_size = batch_size
        self._dtype = route_dtype(max(_num_experts(r) for r in self.routers))
        self._seen: dict[int, Tensor] = {}
        self._handles: list = []


    def _hook(self, position: int):
        def record(module: nn.Module, args, output) -> None:
            experts = output[2]
            # Under activation checkpointing a router fires again in the backward recompute: keep the first.
            if position not in self._seen:
                self._seen[position] = experts.detach().to(self._dtype)

        return record

    def pop(self) -> Tensor:
        """Routes of the forward since the last pop, ``[B, S, L, k]``; ``ValueError`` if no router fired."""
        if len(self._seen) != len(self.routers):
            raise ValueError(f"{len(self._seen)} of {len(self.routers)} routers fired since the last pop: run one "
                             "forward of the whole model between pops")
        layers = [self._seen[i] for i in range(len(self.routers))]
        self._seen = {}
        n, k = layers[0].shape
        if n % self.batch_size:
            raise ValueError(f"the routers saw {n} tokens, not a multiple of batch_size={self.batch_size}")
        return torch.stack(layers, dim=1).reshape(self.batch_size, n // self.batch_size, len(layers), k)

    def pop_rows(self, lengths: list[int]) -> list[Tensor]:
        """:meth:`pop` split into rows of a right-padded forward (row i's tokens start at position 0): row i keeps
        its first ``lengths[i]`` positions — e.g. P_i + C_i − 1 after scoring π_old, to replay in π_θ (R2)."""
        routes = self.pop()
        width = routes.shape[1]
        if len(lengths) != routes.shape[0] or any(n > width for n in lengths):
            raise ValueError(f"lengths must give one length <= {width} per row of the {routes.shape[0]}, got {lengths}")
        return [routes[i, :n].clone() for i, n in enumerate(lengths)]


class replay_routes(_RouterHooks):  # noqa: N801  (a context manager used like a function: ``with replay_routes(...)``)
    """Context manager: forwards of ``model`` inside it route the tokens of each row as recorded in ``routes``.

    Args:
        model: the trainer's MoE model (the same architecture that recorded the routes).
        routes: one integer tensor ``[n_i, L, k]`` per row of the forward's batch — routes of that row's first
            ``n_i`` positions (right-padded layout: row i's tokens start at position 0); later positions route
            natively. ``None`` for a row routes it natively.
        mode: ``"replay"`` uses the recorded experts; ``"compare"`` leaves routing native and only measures how
            often it differs from the record (the flip rate without replay).

    After (or during) the context, ``flip_rate`` is the fraction of recorded (position, layer) pairs whose native
    top-k expert *set* differs from the recorded one, and ``flips`` / ``routed`` its counts (over every forward in
    the context; 0.0 when nothing was recorded); ``flips_per_layer`` / ``routed_per_layer`` are the same counts per
    MoE layer (router order), what :func:`flip_rate_metrics` turns into the trainer's metrics.
    """

    def __init__(self, model: nn.Module, routes: list[Tensor | None],
                 mode: Literal["replay", "compare"] = "replay") -> None:
        if mode not in ("replay", "compare"):
            raise ValueError(f"mode must be 'replay' or 'compare', got {mode!r}")
        self.routers = find_routers(model)
        if not isinstance(routes, (list, tuple)) or not routes:
            raise ValueError("routes must be a non-empty list with one [n_i, L, k] tensor (or None) per row")
        top_k = self.routers[0].top_k
        for i, r in enumerate(routes):
            if r is None:
                continue
            if r.dim() != 3 or r.shape[1] != len(self.routers) or r.shape[2] != top_k:
                raise ValueError(f"routes[{i}] must be [n, L={len(self.routers)}, k={top_k}] for this model, "
                                 f"got {tuple(r.shape)}")
            if r.is_floating_point():
                raise ValueError(f"routes[{i}] must hold integer expert ids, got {r.dtype}")
        self.routes = list(routes)
        self.mode = mode
        self._counts: list[tuple[int, Tensor, Tensor]] = []  # (layer, flipped, recorded) per router call, summed later
        self._renormalises: dict[int, bool] = {}
        self._targets: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # (router, tokens) → experts, has
        self._handles: list = []

    @property
    def flips(self) -> int:
        return sum(self.flips_per_layer)

    @property
    def routed(self) -> int:
        return sum(self.routed_per_layer)

    @property
    def flips_per_layer(self) -> list[int]:
        """Flipped (position, layer) pairs of each MoE layer, in router order."""
        return self._per_layer(1)

    @property
    def routed_per_layer(self) -> list[int]:
        """Recorded (position, layer) pairs of each MoE layer, in router order."""
        return self._per_layer(2)

    def _per_layer(self, column: int) -> list[int]:
        out = [0] * len(self.routers)
        for entry in self._counts:
            out[entry[0]] += int(entry[column])
        return out

    @property
    def flip_rate(self) -> float:
        routed = self.routed
        return self.flips / routed if routed else 0.0


    def _target(self, position: int, n_tokens: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Recorded experts ``[N, k]`` (long) for the flattened ``[B·W]`` tokens of a forward, and which have one."""
        key = (position, n_tokens)
        if key not in self._targets:
            b = len(self.routes)
            if n_tokens % b:
                raise ValueError(f"a router saw {n_tokens} tokens, not a multiple of the {b} rows given routes")
            width = n_tokens // b
            router: Any = self.routers[position]  # an MoE router module: its top_k is a plain int
            k = int(router.top_k)
            experts = torch.zeros(b, width, k, dtype=torch.long, device=device)
            has = torch.zeros(b, width, dtype=torch.bool, device=device)
            for i, r in enumerate(self.routes):
                if r is None:
                    continue
                n = min(r.shape[0], width)
                experts[i, :n] = r[:n, position].to(device=device, dtype=torch.long)
                has[i, :n] = True
            self._targets[key] = (experts.reshape(n_tokens, k), has.reshape(n_tokens))
        return self._targets[key]

    def _hook(self, position: int):
        def replay(module: nn.Module, args, output):
            logits, weights, native = output
            target, has = self._target(position, native.shape[0], native.device)
            if position not in self._renormalises:
                self._renormalises[position] = _gate_renormalises(module, logits, weights, native)
            with torch.no_grad():  # counted on the device; read (one sync) only when flip_rate is asked for
                differs = (native.sort(dim=-1).values != target.sort(dim=-1).values).any(dim=-1) & has
                self._counts.append((position, differs.sum(), has.sum()))
            if self.mode == "compare":
                return None
            experts = torch.where(has[:, None], target, native)
            return logits, _gate_weights(logits, experts, self._renormalises[position]).to(weights.dtype), experts

        return replay


def flip_rates(flips: list[int], routed: list[int]) -> tuple[list[float], float]:
    """The flip rate of each MoE layer, flips_ℓ / routed_ℓ, and over all layers, Σ flips / Σ routed (0.0 where
    nothing was routed) — the counts of :class:`replay_routes` in training or of
    :class:`~offpolicy.inspect.routing_flips.RoutingFlips` in ``offpolicy inspect``.

    >>> flip_rates([1, 0, 3], [4, 4, 4])
    ([0.25, 0.0, 0.75], 0.3333333333333333)
    """
    if len(flips) != len(routed):
        raise ValueError(f"flips and routed must have one count per MoE layer, got {len(flips)} and {len(routed)}")
    total = sum(routed)
    return [f / n if n else 0.0 for f, n in zip(flips, routed)], (sum(flips) / total if total else 0.0)


def flip_rate_metrics(flips: list[int], routed: list[int]) -> dict[str, float]:
    """The trainer's routing metrics from per-layer counts (``replay_routes``' ``flips_per_layer`` /
    ``routed_per_layer``, rates by :func:`flip_rates`): ``routing/flip_rate/layer{i}`` for each MoE layer i (router
    order, from 0) and ``routing/flip_rate`` over all of them.

    >>> flip_rate_metrics([1, 0], [4, 4])
    {'routing/flip_rate/layer0': 0.25, 'routing/flip_rate/layer1': 0.0, 'routing/flip_rate': 0.125}
    """
    per_layer, overall = flip_rates(flips, routed)
    metrics = {f"routing/flip_rate/layer{i}": rate for i, rate in enumerate(per_layer)}
    metrics["routing/flip_rate"] = overall
    return metrics


def _gate_weights(logits: Tensor, experts: Tensor, renormalise: bool) -> Tensor:
    """softmax(router logits) over all experts, gathered at ``experts`` [N, k], renormalised to sum 1 if asked."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights = probs.gather(-1, experts)
    return weights / weights.sum(dim=-1, keepdim=True) if renormalise else weights


def gate_tolerance(logits: Tensor, weights: Tensor) -> float:
    """How far the replay's gate weights (:func:`_gate_weights`) and the router's own may differ through rounding
    alone, in probability: two float32 softmaxes over the E router logits of magnitude ≤ A (transformers' routers
    take the softmax in float32 from the same logits, as the replay does;
    :func:`~offpolicy.tolerances.log_softmax_tolerance` — p ≤ 1, so an error in log p bounds the error in p), the
    k-term renormalising sum (:func:`~offpolicy.tolerances.rounding_tolerance`), and each side's rounding of weights
    ≤ 1 to the weights' dtype (u each: ε)."""
    a = float(max_abs_finite(logits.detach().float()).max()) if logits.numel() else 0.0
    k = max(int(weights.shape[-1]), 1)
    softmax = float(log_softmax_tolerance(torch.float32, a, int(logits.shape[-1])))
    return softmax + rounding_tolerance(torch.float32, 1.0, terms=k) + eps(weights.dtype)


def _gate_renormalises(router: nn.Module, logits: Tensor, weights: Tensor, experts: Tensor) -> bool:
    """Whether ``router`` renormalises its top-k weights; checked against its own native output within
    :func:`gate_tolerance`, so a router whose gate is computed another way is refused instead of replayed wrongly."""
    declared = bool(getattr(router, "norm_topk_prob", True))  # Mixtral has no flag and always renormalises
    tol = gate_tolerance(logits, weights)
    gaps = []
    with torch.no_grad():
        for renormalise in (declared, not declared):
            mine = _gate_weights(logits, experts, renormalise).to(weights.dtype)
            gap = float((mine.float() - weights.detach().float()).abs().max()) if weights.numel() else 0.0
            if gap <= tol:
                return renormalise
            gaps.append(gap)
    raise ValueError(
        f"routing replay cannot reproduce the gate weights of {type(router).__name__} (off by {min(gaps):.3g} at "
        f"best, past the {tol:.3g} that rounding allows for {weights.dtype} weights "
        f"over {logits.shape[-1]} experts): it supports routers whose weights are the softmax of the router logits at "
        "the top-k experts, optionally renormalised; train without it (rollout.routing_replay=none) or give the "
        "router that gate"
    )


def split_routes(routes: Tensor, attention: Tensor, lengths: list[int]) -> list[Tensor]:
    """Per-row routes from a padded record: row i keeps the first ``lengths[i]`` positions where ``attention`` [B, S]
    is True (left or right padding alike). ``routes`` is ``[B, S, L, k]``.

    >>> r = torch.arange(6).reshape(2, 3, 1, 1)
    >>> [x.flatten().tolist() for x in split_routes(r, torch.tensor([[0, 1, 1], [1, 1, 1]]).bool(), [2, 1])]
    [[1, 2], [3]]
    """
    out = []
    for i, n in enumerate(lengths):
        kept = routes[i][attention[i]]
        if kept.shape[0] < n:
            raise ValueError(f"row {i} has {kept.shape[0]} recorded positions, fewer than the {n} asked for")
        out.append(kept[:n].clone())
    return out
