"""Adaptive Layerwise Perturbation (ALP, arXiv 2603.19470 §3.2).

ALP adds learnable Gaussian noise to the *input* hidden state of each selected decoder layer of the training policy
during the policy update only:

    h'_l = h_l + σ_l · ε,    ε ~ N(0, I) elementwise, fresh every forward,    σ_l = exp(log σ_l)  (learnable)

and optimises a single unified ratio π_{θ,σ}/μ against the rollout engine's log-probs (no separate π_old/μ factor),
at token level (eq. 2) or sequence level — ``sequence`` is eq. 3's product ratio, ``geometric`` the length-normalised
one of the authors' code (our level names mean the same everywhere) — with PPO clipping (token 0.2/0.28, sequence
0.5/3.0, dual-clip c = 10; arXiv 2603.19470 App. B).

Why noise helps (arXiv 2603.19470 §3.3): smoothing π_θ with Gaussian noise enlarges the training policy family so it covers
the inference engine's systematic bias ζ (KL ≤ −ln α + C d E‖ζ‖² / 2σ², eq. 5–6) and flattens sharp optima.

The noise is *off* by default: π_old and reference log-probs must come from the unperturbed model. Turn it on only
for the π_θ forward of an update::

    alp = LayerwisePerturbation(model)                # hooks every decoder layer
    opt = torch.optim.AdamW([{"params": model.parameters(), "lr": 1e-6}, alp.param_group(lr=5e-4)])
    with alp.active():
        logits = model(input_ids).logits               # perturbed π_{θ,σ}
    loss, metrics = alp_policy_loss(batch, level="token")

σ lives in this module (not in the model), so ``model.state_dict()`` / ``save_pretrained`` stay clean; save
``alp.state_dict()`` (just ``log_sigma``) next to it.

Activation checkpointing (TRL's default ``gradient_checkpointing=True``, verl's ``enable_gradient_checkpointing``)
re-runs each decoder layer, hooks included, inside the backward pass — after ``active()`` has been left. Each noisy
draw therefore records where the layer's input lives (its memory address and layout) and the state of the generator
it came from (a few bytes to 5 KB, not the noise); a hook that runs inside a backward pass on that same memory (the
checkpoint keeps the input; FSDP's hooks may hand the layer a new tensor object on it) replays the draw, so the
re-run sees the very noise the forward saw, and a re-run of a forward that drew none stays clean. A later forward
on the same memory drops the record (that input is gone), and switching the noise on drops them all.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor, nn

from offpolicy.batch import LogProbBatch

Target = Literal["all", "logits"]

# Paper defaults (arXiv 2603.19470 §4 and App. B).
DEFAULT_INIT_STD = 1e-4
DEFAULT_LR = 5e-4
TOKEN_CLIP = (0.2, 0.28)
SEQUENCE_CLIP = (0.5, 3.0)
DUAL_CLIP = 10.0


def _get_attr_path(root: nn.Module, path: str) -> object:
    obj: object = root
    for part in path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"layers_path {path!r} does not exist on {type(root).__name__} (missing {part!r})")
        obj = getattr(obj, part)
    return obj


def find_decoder_layers(model: nn.Module, layers_path: str | None = None) -> nn.ModuleList:
    """The decoder blocks of an HF causal LM (or any ``nn.Module``), found generically.

    Order of preference: ``layers_path`` (e.g. ``"model.layers"``, ``"transformer.h"``) if given; otherwise the
    *outermost* ``nn.ModuleList`` whose children all share one class (the stack of blocks), the longest on ties.
    Outermost, not longest: a mixture-of-experts layer holds its experts in such a list too, often with more entries
    than the model has layers, but always inside a decoder layer.

    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.heads = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])
    ...         self.blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    >>> len(find_decoder_layers(Net()))
    3
    """
    if layers_path is not None:
        found = _get_attr_path(model, layers_path)
        if not isinstance(found, nn.ModuleList):
            raise ValueError(f"layers_path {layers_path!r} is a {type(found).__name__}, not an nn.ModuleList")
        return found
    best: nn.ModuleList | None = None
    best_depth = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1:
            depth = name.count(".")
            if best is None or depth < best_depth or (depth == best_depth and len(module) > len(best)):
                best, best_depth = module, depth
    if best is None:
        raise ValueError(f"model {type(model).__name__} has no nn.ModuleList of decoder layers; pass layers_path=")
    return best


def find_output_head(model: nn.Module) -> nn.Module:
    """The lm_head (``get_output_embeddings()`` for HF models, else an attribute named ``lm_head``)."""
    lm: Any = model  # an HF model's get_output_embeddings (torch types module attributes as Tensor | Module)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is None:
        head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module):
        raise ValueError(f"model {type(model).__name__} has no output head (lm_head); cannot use target='logits'")
    return head


def _where(h: Tensor) -> tuple:
    """Where ``h`` lives: device, memory address, offset, shape and strides — the same for the tensor a checkpoint
    re-runs a layer on (the input it kept, a detached alias of it, or a new tensor object FSDP's hooks make on it)."""
    return (str(h.device), h.untyped_storage().data_ptr(), h.storage_offset(), tuple(h.shape), h.stride())


class LayerwisePerturbation(nn.Module):
    """Learnable per-layer Gaussian noise on decoder-layer inputs (ALP, arXiv 2603.19470 eqs. 2–3).

    Args:
        model: any causal LM; hooks are registered on it at construction.
        layers: ``"all"`` (default) or a sequence of layer indices (negative allowed) for the layer-subset ablation,
            or ``"logits"`` for the logits-only ablation (arXiv 2603.19470 §6.1: noise on the output logits, no hidden-state
            perturbation — added to the lm_head's output, σ·ε i.i.d. over the vocabulary).
        init_std: initial σ for every hooked layer (paper default 1e-4).
        layers_path: dotted path to the decoder ``nn.ModuleList`` when auto-detection is not wanted.
        seed: if given, noise comes from a private ``torch.Generator`` seeded with it (reproducible, and it does not
            consume the global RNG); otherwise from the global RNG.

    ``log_sigma`` is an ``nn.Parameter`` of shape ``[n_hooked]``; σ = exp(log σ) keeps it positive. The noise is
    computed in float32 and added in the hidden state's dtype; the gradient reaches ``log_sigma`` through σ·ε.

    >>> class Block(nn.Module):
    ...     def forward(self, h):
    ...         return h
    >>> class Tiny(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.layers = nn.ModuleList([Block(), Block()])
    ...     def forward(self, h):
    ...         for layer in self.layers:
    ...             h = layer(h)
    ...         return h
    >>> net = Tiny(); alp = LayerwisePerturbation(net, init_std=0.1, seed=0)
    >>> x = torch.zeros(1, 4)
    >>> bool((net(x) == 0).all())          # off by default
    True
    >>> with alp.active():
    ...     y = net(x)
    >>> bool((y != 0).any()), alp.num_layers
    (True, 2)
    >>> alp.remove(); bool((net(x) == 0).all())
    True
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        layers: Target | Sequence[int] = "all",
        init_std: float = DEFAULT_INIT_STD,
        layers_path: str | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if not (isinstance(init_std, (int, float)) and math.isfinite(init_std) and init_std > 0):
            raise ValueError(f"init_std must be a finite positive number, got {init_std!r}")
        if layers == "logits":
            targets: list[nn.Module] = [find_output_head(model)]
            self.layer_indices: tuple[int, ...] = ()
        else:
            blocks = find_decoder_layers(model, layers_path)
            n = len(blocks)
            if layers == "all":
                idx = list(range(n))
            elif isinstance(layers, str):
                raise ValueError(f"layers must be 'all', 'logits' or a sequence of ints, got {layers!r}")
            else:
                idx = []
                for i in layers:
                    if not isinstance(i, int) or not -n <= i < n:
                        raise ValueError(f"layers contains {i!r}, outside the model's {n} decoder layers")
                    idx.append(i % n)
                if not idx:
                    raise ValueError("layers is empty; select at least one layer (or use 'all' / 'logits')")
                if len(set(idx)) != len(idx):
                    raise ValueError(f"layers has duplicates: {list(layers)!r}")
            targets = [blocks[i] for i in idx]
            self.layer_indices = tuple(idx)
        self.target: str = "logits" if layers == "logits" else "layers"
        self.log_sigma = nn.Parameter(torch.full((len(targets),), math.log(init_std), dtype=torch.float32))
        self._enabled = False
        self._precision_checked = False  # see _warn_if_noise_rounds_away
        self._seed = seed
        self._generators: dict[str, torch.Generator] = {}
        # per hooked module: (where its input lives, generator state) of each noisy draw a checkpoint may re-run
        self._drawn: list[list[tuple[tuple, Tensor]]] = [[] for _ in targets]
        if self.target == "logits":  # on the head's output: i.i.d. logit noise, not a rank-H image of hidden noise
            self._handles = [targets[0].register_forward_hook(self._output_hook)]
        else:
            self._handles = [
                t.register_forward_pre_hook(self._make_hook(i), with_kwargs=True) for i, t in enumerate(targets)
            ]

    # -- noise -------------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """Number of hooked modules (1 for the logits-only ablation)."""
        return self.log_sigma.numel()

    @property
    def sigma(self) -> Tensor:
        """σ = exp(log σ), shape [num_layers], with grad."""
        return self.log_sigma.exp()

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self._seed is None:
            return None
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self._seed)
        return self._generators[key]

    def _rng_state(self, device: torch.device) -> Tensor:
        """The state the next draw on ``device`` starts from: the private generator's, else the global one's."""
        generator = self._generator(device)
        if generator is not None:
            return generator.get_state()
        if device.type == "cpu":
            return torch.get_rng_state()
        return torch.get_device_module(device.type).get_rng_state(device)

    def _noisy(self, h: Tensor, i: int) -> Tensor:
        """h + σ_i ε with a fresh ε."""
        return self._add_noise(h, i, self._generator(h.device))

    def _replayed(self, h: Tensor, i: int, state: Tensor) -> Tensor:
        """h + σ_i ε with the ε a generator in the recorded ``state`` draws (a checkpoint re-run's noise)."""
        generator = torch.Generator(device=h.device)
        generator.set_state(state)
        return self._add_noise(h, i, generator)

    def _add_noise(self, h: Tensor, i: int, generator: torch.Generator | None) -> Tensor:
        eps = torch.randn(h.shape, generator=generator, device=h.device, dtype=torch.float32)
        sigma = self.log_sigma[i].exp()
        noisy = h.float() + sigma * eps
        if h.dtype in (torch.bfloat16, torch.float16) and not self._precision_checked:
            self._warn_if_noise_rounds_away(h, noisy)
        return noisy.to(h.dtype)

    def _hooked(self, h: Tensor, i: int) -> Tensor | None:
        """What hook ``i`` puts in place of ``h``: None (no noise), a fresh draw, or — inside a backward pass, where
        activation checkpointing re-runs the layer on the input it kept — the draw its forward made (module
        docstring)."""
        drawn, key = self._drawn[i], _where(h)
        if torch._C._current_graph_task_id() != -1:  # a backward pass is running: this is a checkpoint's re-run
            for k, (where, state) in enumerate(drawn):
                if where == key:
                    del drawn[k]
                    return self._replayed(h, i, state)
            return None  # its forward drew no noise
        drawn[:] = [(where, state) for where, state in drawn if where != key]  # that input's memory is reused
        if not self._enabled:
            return None
        drawn.append((key, self._rng_state(h.device)))
        return self._noisy(h, i)

    def _warn_if_noise_rounds_away(self, h: Tensor, noisy: Tensor) -> None:
        """Once: warn when casting back to a 16-bit hidden state erases most of the noise. At the paper's σ = 1e-4
        and |h| ~ 1, bf16's spacing (~8e-3) keeps about 2 % of it, while log σ still gets the gradient of the
        full noise (the cast's backward is the identity). One host sync, on the first noisy forward only."""
        self._precision_checked = True
        with torch.no_grad():
            kept = (noisy.to(h.dtype) != h).float().mean().item()
        if kept < 0.5:
            warnings.warn(
                f"ALP: only {kept:.1%} of the {h.dtype} hidden-state elements change when noise of σ = "
                f"{float(self.sigma.detach().min()):.1e}… is added (the rest rounds away in {h.dtype}); use a larger init_std "
                "or a float32 model for the update forward",
                stacklevel=3,
            )

    def _make_hook(self, i: int):  # noqa: ANN202 - torch hook signature
        def hook(module: nn.Module, args: tuple, kwargs: dict):  # noqa: ANN202
            if not self._enabled and not any(self._drawn):
                return None
            if args and isinstance(args[0], Tensor):
                noisy = self._hooked(args[0], i)
                return None if noisy is None else ((noisy, *args[1:]), kwargs)
            if isinstance(kwargs.get("hidden_states"), Tensor):
                noisy = self._hooked(kwargs["hidden_states"], i)
                return None if noisy is None else (args, {**kwargs, "hidden_states": noisy})
            raise ValueError(f"ALP hook on {type(module).__name__}: no hidden-state tensor in its inputs")

        return hook

    def _output_hook(self, module: nn.Module, args: tuple, output: object):  # noqa: ANN202 - torch hook signature
        if not self._enabled and not any(self._drawn):
            return None
        if not isinstance(output, Tensor):
            raise ValueError(f"ALP logits hook on {type(module).__name__}: its output is not a tensor")
        return self._hooked(output, 0)

    # -- switching -----------------------------------------------------------------------------------------------
    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def enabled(self, flag: bool = True) -> LayerwisePerturbation:
        """Switch the noise on (``True``) or off. Returns self."""
        if not self._handles and flag:
            raise ValueError("this LayerwisePerturbation was removed; its hooks are gone")
        if flag and not self._enabled:  # a new noisy forward: earlier draws no checkpoint re-ran are stale
            for drawn in self._drawn:
                drawn.clear()
        self._enabled = bool(flag)
        return self

    @contextmanager
    def active(self, flag: bool = True) -> Iterator[LayerwisePerturbation]:
        """Context manager: noise on inside (``flag=False`` forces it off), previous state restored after."""
        before = self._enabled
        self.enabled(flag)
        try:
            yield self
        finally:
            self._enabled = before

    def remove(self) -> None:
        """Detach every hook from the model (idempotent). The model behaves exactly as before ALP was attached."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._enabled = False

    # -- optimisation and checkpoints ----------------------------------------------------------------------------
    def param_group(self, lr: float = DEFAULT_LR, weight_decay: float = 0.0) -> dict:
        """An optimizer param group for ``log_sigma`` with its own lr (paper 5e-4) and no weight decay."""
        return {"params": [self.log_sigma], "lr": lr, "weight_decay": weight_decay, "name": "alp"}

    def reseed(self, seed: int) -> None:
        """Restart the private noise generators from ``seed`` (the trainer reseeds every step from (seed, step), so a
        resumed run draws the same noise as an uninterrupted one)."""
        self._seed = int(seed)
        self._generators = {}

    def generator_states(self) -> dict[str, Tensor]:
        """RNG states of the private generators (empty without ``seed``), for exact resume."""
        return {k: g.get_state() for k, g in self._generators.items()}

    def set_generator_states(self, states: dict[str, Tensor]) -> None:
        """Restore what :meth:`generator_states` returned."""
        for key, state in states.items():
            self._generator(torch.device(key))
            if key in self._generators:
                self._generators[key].set_state(state)

    def metrics(self, prefix: str = "alp/") -> dict[str, Tensor]:
        """σ statistics as 0-d detached tensors (mean, min, max and per layer)."""
        s = self.sigma.detach()
        out = {f"{prefix}sigma_mean": s.mean(), f"{prefix}sigma_min": s.min(), f"{prefix}sigma_max": s.max()}
        names = self.layer_indices if self.layer_indices else ("logits",)
        for j, name in enumerate(names):
            out[f"{prefix}sigma/{name}"] = s[j]
        return out

    def extra_repr(self) -> str:
        where = "logits" if self.target == "logits" else f"layers={list(self.layer_indices)}"
        return f"{where}, enabled={self._enabled}"


def alp_clip_defaults(level: str) -> tuple[float, float]:
    """Paper clip range (ε_low, ε_high): token (0.2, 0.28); sequence/geometric (0.5, 3.0) (arXiv 2603.19470 App. B).

    >>> alp_clip_defaults("token"), alp_clip_defaults("geometric")
    ((0.2, 0.28), (0.5, 3.0))
    """
    if level == "token":
        return TOKEN_CLIP
    if level in ("sequence", "geometric"):
        return SEQUENCE_CLIP
    raise ValueError(f"level must be 'token', 'geometric' or 'sequence', got {level!r}")


def alp_policy_loss(
    batch: LogProbBatch,
    *,
    level: str = "token",
    correction: object | None = None,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = DUAL_CLIP,
    aggregation: str = "token_mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """ALP's loss: PPO clipping on the single unified ratio π_{θ,σ}/μ (arXiv 2603.19470 eq. 2 token, eq. 3 sequence).

    ``batch.logp`` must come from a forward with the perturbation *on*; ``batch.rollout_logp`` is μ (the inference
    engine, unperturbed). There is no π_old/μ factor: this is ``policy_loss(objective="bypass")`` at ``level``:
    ``token`` (eq. 2), ``sequence`` (eq. 3, the product Π_t ρ_t) or ``geometric`` (the length-normalised ratio the
    authors' code uses for its sequence level). Clip defaults are the paper's: token (0.2, 0.28), sequence and
    geometric (0.5, 3.0); dual-clip c = 10.

    >>> logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    >>> b = LogProbBatch(logp=logp, mask=torch.ones(1, 2), rollout_logp=torch.tensor([[-1.0, -2.0]]),
    ...                  advantages=torch.tensor([1.0]))
    >>> loss, _ = alp_policy_loss(b)   # r = (1, e); e is clipped at 1.28: L = -(1 + 1.28) / 2
    >>> round(loss.item(), 4)
    -1.14
    """
    from offpolicy.losses import policy_loss  # deferred: perturbation does not otherwise need the loss module

    low, high = alp_clip_defaults(level)
    if batch.rollout_logp is None:
        raise ValueError("batch.rollout_logp: ALP's unified ratio π_{θ,σ}/μ needs the rollout engine's log-probs")
    return policy_loss(
        batch,
        correction=correction,  # type: ignore[arg-type]
        objective="bypass",
        level=level,  # type: ignore[arg-type]
        clip_low=low if clip_low is None else clip_low,
        clip_high=high if clip_high is None else clip_high,
        dual_clip=dual_clip,
        aggregation=aggregation,
    )


# -- σ across processes and in checkpoints: the one format every host writes -------------------------------------------

ALP_CHECKPOINT_FILE = "offpolicy_alp.pt"


def allreduce_sigma_grad(alp: LayerwisePerturbation, group: Any = None) -> bool:
    """Average ``alp.log_sigma.grad`` over the processes of ``group`` (None: the default group; a list: each group
    in turn — averaging over each dimension of a mesh averages over all of it) when torch.distributed is initialised
    with more than one process; a process without a gradient contributes zeros (so no rank waits forever). σ lives
    outside the model, so the host's DDP / FSDP never averages its gradient. Returns True when it communicated.

    >>> alp = LayerwisePerturbation(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Identity()])))
    >>> allreduce_sigma_grad(alp)       # not distributed: nothing to do
    False
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    communicated = False
    for g in group if isinstance(group, list) else [group]:
        processes = dist.get_world_size(g)
        if processes == 1:
            continue
        if alp.log_sigma.grad is None:
            alp.log_sigma.grad = torch.zeros_like(alp.log_sigma)
        dist.all_reduce(alp.log_sigma.grad, op=dist.ReduceOp.SUM, group=g)
        alp.log_sigma.grad.div_(processes)
        communicated = True
    return communicated


def save_alp(alp: LayerwisePerturbation, folder: Any) -> str:
    """Write σ, the layers it perturbs and the noise generators' states to ``folder/offpolicy_alp.pt`` (tensors,
    ints and strings only: :func:`load_alp` reads it with ``weights_only=True``); returns the path."""
    import os

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, ALP_CHECKPOINT_FILE)
    torch.save({"state_dict": alp.state_dict(), "layers": list(alp.layer_indices),
                "generators": alp.generator_states()}, path)
    return path


def load_alp(alp: LayerwisePerturbation, folder: Any, *, setting: str = "folder") -> None:
    """Restore what :func:`save_alp` wrote into ``alp`` (σ in place: the optimiser keeps the same parameter). A
    missing file, or σ of other layers, is refused in one line naming ``setting`` (the host's checkpoint option)."""
    import os

    path = os.path.join(folder, ALP_CHECKPOINT_FILE)
    if not os.path.exists(path):
        raise ValueError(f"{setting}: {folder} has no {ALP_CHECKPOINT_FILE} (σ of ALP); it was not written with ALP on")
    state = torch.load(path, map_location=alp.log_sigma.device, weights_only=True)
    if tuple(state["layers"]) != alp.layer_indices:
        raise ValueError(f"{setting}: {path} holds σ of layers {state['layers']}, ALP here perturbs layers "
                         f"{list(alp.layer_indices)}")
    alp.load_state_dict(state["state_dict"])
    alp.set_generator_states(state["generators"])
