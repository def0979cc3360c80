"""Sampling replay / DVP in TRL: every forward of π_old and π_θ scored under the engine's recipe, in its filter order
(:mod:`offpolicy.integrations.trl.replay`), from the backbone's last hidden state with the head recomputed as
h·Wᵀ + b; with the engine's top-k (top-k TRM, score centering) the update forward does the same, and the log-probs,
the entropy, the top-k bounds and the centre come from one pass over the head
(:func:`offpolicy.forward_scores.token_scores`).

Settings: ``sampling_replay``, ``dvp_rho`` (DVP, arXiv 2512.23087: ``min_p = ρ`` for the engine),
``memory_budget_bytes``. Metrics: ``offpolicy/dvp/…`` (logged by the ``dvp_keep`` correction).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offpolicy.corrections.vocabulary import dvp_keep
from offpolicy.forward_scores import TokenScores, token_scores
from offpolicy.integrations.trl.parts import TRLBase
from offpolicy.integrations.trl.parts.sharding import gathered_head
from offpolicy.integrations.trl.replay import ENGINE_ORDERS, ReplayHistory, trl_engine, trl_sampling_recipe
from offpolicy.integrations.trl.topk import own_slack_rows


@dataclass
class Scores:
    """One forward's per-token outputs ``[B, T]``: the log-probs (replayed when the recipe is on), whether the token
    is inside the trainer's support, the retained mass, the top-k KL bounds (None without top-k), the MoE aux loss,
    score centering's top-k centre and drift (None unless asked), the entropy (on the replayed support under the
    recipe; None unless asked)."""

    logp: Tensor
    inside: Tensor
    mass: Tensor
    kl_lower: Tensor | None
    kl_upper: Tensor | None
    aux_loss: Tensor | None
    center: Tensor | None = None
    own_slack: Tensor | None = None  # [len(ks), b, T]: π's own top-K' slack, for the top-k advice (first batch)
    entropy: Tensor | None = None
    drift: Tensor | None = None


def _scatter(x: Tensor, rows: Tensor, valid: Tensor, fill: float | bool = 0) -> Tensor:
    """``[b, T]`` like ``valid`` from the values ``x`` [len(rows)] of its flat positions ``rows``, ``fill`` elsewhere
    (differentiable in ``x``)."""
    return x.new_full((valid.numel(),), fill).index_copy(0, rows, x).reshape(valid.shape)


def _with_min_p(args: tuple, kwargs: dict, rho: float) -> tuple[tuple, dict]:
    """DVP: a copy of the ``GRPOConfig`` with ``min_p = max(min_p, ρ)`` (TRL reads it when it builds its engines)."""
    if "args" in kwargs and kwargs["args"] is not None:
        cfg = copy.copy(kwargs["args"])
        cfg.min_p = max(float(cfg.min_p or 0.0), rho)
        return args, {**kwargs, "args": cfg}
    if len(args) > 2 and args[2] is not None:
        cfg = copy.copy(args[2])
        cfg.min_p = max(float(cfg.min_p or 0.0), rho)
        return (*args[:2], cfg, *args[3:]), kwargs
    raise ValueError("dvp_rho: pass args=GRPOConfig(...) (DVP sets its min_p before TRL builds the engines)")


def _grpo_args(args: tuple, kwargs: dict) -> Any:
    """The ``GRPOConfig`` given to the trainer (keyword ``args`` or the third positional argument), or None."""
    if kwargs.get("args") is not None:
        return kwargs["args"]
    return args[2] if len(args) > 2 else None


def _backbone_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, Tensor, Tensor | None]:
    wrapped: Any = model  # a transformers / PEFT model: its methods are not on ``torch.nn.Module``'s type
    core = wrapped.get_base_model() if hasattr(wrapped, "get_base_model") else wrapped
    head = core.get_output_embeddings()
    weight, bias = gathered_head(head.weight, head.bias)  # FSDP2: all-gathered; ZeRO-3 / FSDP1: refused
    return core.base_model, weight, bias


def _check_plain_head(model: Any) -> None:
    """Replay and top-k recompute the head as h·Wᵀ + b: refuse models whose head also scales or soft-caps."""
    config = getattr(model, "config", None)
    if config is None:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        value = getattr(text, key, None)
        if value is not None and value != 1.0:
            raise ValueError(f"model: its config sets {key}={value!r}, which the sampling replay / top-k scoring "
                             "does not apply; turn them off for this model")


class ReplayScoring(TRLBase):
    """The forward under the sampling recipe and for top-k (a part of ``OffPolicyGRPOMixin``)."""

    def _setup_replay(self, train_args: Any, replay: bool, memory_budget_bytes: int) -> None:
        """The recipe to replay (None: off), the engine's filter order, DVP's support as a correction, the budget."""
        self.offpolicy_budget = memory_budget_bytes
        self.offpolicy_recipe = trl_sampling_recipe(train_args) if replay else None
        self.offpolicy_order = ENGINE_ORDERS[trl_engine(train_args)]
        self._offpolicy_keep = dvp_keep() if replay else None

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: Tensor, attention_mask: Tensor,
                                           logits_to_keep: int, batch_size: int | None = None,
                                           compute_entropy: bool = False, compute_aux_loss: bool = False,
                                           **model_inputs: Any) -> tuple[Tensor, Tensor | None, Tensor | None]:
        if self.offpolicy_recipe is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **model_inputs)
        s = self._offpolicy_scores(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                                   compute_aux_loss=compute_aux_loss, compute_entropy=compute_entropy,
                                   **model_inputs)
        return s.logp, s.entropy, s.aux_loss

    # -- the forward ------------------------------------------------------------------------------------------
    def _offpolicy_scores(self, model: Any, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, *,
                          batch_size: int | None = None, compute_aux_loss: bool = False,
                          compute_entropy: bool = False,
                          topk: tuple[Tensor | None, Tensor | None] | None = None,
                          **model_inputs: Any) -> Scores:
        """Per-token scores ``[B, T]`` of the completion tokens: TRL's model call with the backbone's last hidden
        state captured. Under the sampling recipe or with the engine's top-k the model computes one position's
        logits and the head is recomputed from the hidden states of the scored tokens in one row-chunked pass
        (:meth:`_offpolicy_head`: log-probs, entropy, top-k bounds, centre); otherwise TRL's fused head scores
        them. ``compute_entropy``: the entropy of the distribution the tokens are scored under (softmax(z/T), or
        on the replayed support), with a gradient only when TRL's entropy bonus is on."""
        if any(v is not None for v in model_inputs.values()):
            raise ValueError("model inputs: vision inputs are not supported with sampling replay or top-k TRM")
        recipe = self.offpolicy_recipe
        unwrapped = self.accelerator.unwrap_model(model) if hasattr(self, "accelerator") else model
        backbone, weight, bias = _backbone_and_head(unwrapped)
        captured: dict[str, Tensor] = {}

        def grab(module: Any, args: Any, output: Any) -> None:
            captured["h"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        t_len = logits_to_keep
        batch_size = batch_size or input_ids.size(0)
        parts: list[Scores] = []
        for start in range(0, input_ids.size(0), batch_size):
            ids = input_ids[start:start + batch_size]
            att = attention_mask[start:start + batch_size]
            labels = ids.masked_fill(att == 0, -100)
            labels[:, :-t_len] = -100
            extra: dict[str, Any] = {"output_router_logits": True} if compute_aux_loss else {}
            own_head = recipe is not None or (topk is not None and topk[0] is not None)
            if own_head:
                # the head is recomputed from the hidden states: the model's own forward with one position's
                # logits (TRL's fused head would score every position off CUDA, where it does not drop the ignored
                # labels)
                extra.update(fused_lm_head=False, logits_to_keep=1, use_cache=False)
            else:
                extra.update(fused_lm_head=True, labels=labels)
            handle = backbone.register_forward_hook(grab)
            try:
                autocast = self.accelerator.autocast() if hasattr(self, "accelerator") else nullcontext()
                with autocast:
                    out = model(input_ids=ids, attention_mask=att, **extra)
            finally:
                handle.remove()
            valid = att[:, -t_len:].bool()
            targets = ids[:, -t_len:]
            rows = valid.reshape(-1).nonzero().squeeze(-1)
            h = captured.pop("h")[:, -t_len - 1:-1].reshape(-1, weight.shape[1])[rows]

            lower = upper = center = own = entropy = drift = None
            if own_head:
                r = self._offpolicy_head(h, weight, bias, ids, att, targets, valid, rows, start, batch_size,
                                         topk, compute_entropy)
                assert r.logp is not None and r.mass is not None  # asked for (token_scores' defaults)
                logp, inside = _scatter(r.logp, rows, valid), _scatter(r.inside, rows, valid, True)
                mass = _scatter(r.mass.float(), rows, valid, 1.0)
                entropy, lower, upper, center, drift = (None if x is None else _scatter(x, rows, valid)
                                                        for x in (r.entropy, r.kl_lower, r.kl_upper, r.center,
                                                                  r.drift))
            else:
                logp = out.log_probs[:, -t_len:]
                inside = torch.ones_like(valid)
                mass = torch.ones(valid.shape, device=ids.device)
                entropy = out.entropy[:, -t_len:] if compute_entropy else None
            if start == 0 and topk is not None and topk[0] is not None and self._offpolicy_advice_ks \
                    and torch.is_grad_enabled():  # the first update only
                temperature = float(getattr(self.args, "temperature", 1.0) or 1.0)
                own = own_slack_rows(h.detach(), weight.detach(), rows, (valid.shape[0], valid.shape[1]),
                                     self._offpolicy_advice_ks, bias=None if bias is None else bias.detach(),
                                     temperature=temperature, memory_budget_bytes=self.offpolicy_budget)
            parts.append(Scores(logp, inside, mass, lower, upper, getattr(out, "aux_loss", None), center,
                                own if start == 0 and topk is not None else None, entropy, drift))

        def cat(name: str) -> Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values)

        def cat_present(name: str) -> Tensor:
            out = cat(name)
            assert out is not None, name  # set on every part
            return out

        aux: Tensor | None = None
        if compute_aux_loss:
            aux_losses: list[Tensor] = []
            for p in parts:
                assert p.aux_loss is not None, "compute_aux_loss: the model returned no aux_loss"
                aux_losses.append(p.aux_loss)
            aux = torch.stack(aux_losses).mean()
        return Scores(cat_present("logp"), cat_present("inside"), cat_present("mass"), cat("kl_lower"),
                      cat("kl_upper"), aux, cat("center"), parts[0].own_slack, cat("entropy"), cat("drift"))

    def _offpolicy_head(self, h: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, att: Tensor,
                        targets: Tensor, valid: Tensor, rows: Tensor, start: int, batch_size: int,
                        topk: tuple[Tensor | None, Tensor | None] | None, compute_entropy: bool) -> TokenScores:
        """One pass over the head (:func:`~offpolicy.forward_scores.token_scores`) for the scored rows
        ``rows`` (flat positions of the ``[b, T]`` completion block ``valid``) of one model batch from ``start``:
        the (replayed) log-probs, the entropy when asked (with a gradient only when TRL's entropy bonus is on), the
        top-k bounds and score centering's centre (and, in the update forward, the drift it logs) when the batch
        carries the engine's top-k."""
        recipe = self.offpolicy_recipe
        t_len = targets.shape[1]
        history = None
        if recipe is not None and recipe.reads_history:
            # HF generate's repetition penalty sees the left-padded prompt (pad tokens too); vLLM sees the prompt
            # alone
            prompt, seen = ids[:, :-t_len], att[:, :-t_len].bool()
            if self.offpolicy_order != ENGINE_ORDERS["vllm"]:
                seen = torch.ones_like(seen)
            prompts = [p[k].tolist() for p, k in zip(prompt, seen)]
            history = ReplayHistory(prompts, targets, valid, rows)
        top: tuple[Tensor, Tensor] | None = None
        if topk is not None and topk[0] is not None:
            assert topk[1] is not None  # stored with the log-probs (_generate_single_turn)
            n_all = valid.numel()
            top = (topk[0][start:start + batch_size].reshape(n_all, -1)[rows],
                   topk[1][start:start + batch_size].reshape(n_all, -1)[rows])
        grad = torch.is_grad_enabled()
        return token_scores(targets.reshape(-1)[rows], hidden=h, weight=weight, bias=bias,
                            temperature=float(getattr(self.args, "temperature", 1.0) or 1.0), recipe=recipe,
                            order=self.offpolicy_order, history=history, entropy=compute_entropy,
                            entropy_grad=compute_entropy and grad and self._offpolicy_entropy_grad(), topk=top,
                            bounds=top is not None and self.offpolicy_topk_bounds,
                            center=top is not None and self.offpolicy_score_centering,
                            drift=top is not None and self.offpolicy_score_centering and grad,
                            memory_budget_bytes=self.offpolicy_budget)

    def _offpolicy_entropy_grad(self) -> bool:
        """TRL's entropy bonus is on (static ``entropy_coef`` ≠ 0 or adaptive): the entropy needs its gradient."""
        return bool(getattr(self, "_entropy_bonus_enabled", False))
