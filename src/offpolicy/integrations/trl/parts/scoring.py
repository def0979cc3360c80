"""Sampling replay / DVP in TRL: every forward of π_old and π_θ scored under the engine's recipe, in its filter order
(:mod:`offpolicy.integrations.trl.replay`), from the backbone's last hidden state with the head recomputed as
h·Wᵀ + b; top-k TRM's bounds and score centering's centre come from the same hidden state.

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
from offpolicy.integrations.trl.parts import TRLBase
from offpolicy.integrations.trl.replay import ENGINE_ORDERS, ReplayHistory, replay_logp, trl_engine, trl_sampling_recipe
from offpolicy.integrations.trl.terms import replay_entropy
from offpolicy.integrations.trl.topk import own_slack_rows, topk_divergence, topk_score_center


@dataclass
class Scores:
    """One forward's per-token outputs ``[B, T]``: the log-probs (replayed when the recipe is on), whether the token
    is inside the trainer's support, the retained mass, the top-k KL bounds (None without top-k), the MoE aux loss,
    score centering's top-k centre (None unless asked), the entropy (on the replayed support under the recipe; None
    unless asked)."""

    logp: Tensor
    inside: Tensor
    mass: Tensor
    kl_lower: Tensor | None
    kl_upper: Tensor | None
    aux_loss: Tensor | None
    center: Tensor | None = None
    own_slack: Tensor | None = None  # [len(ks), b, T]: π's own top-K' slack, for the top-k advice (first batch)
    entropy: Tensor | None = None



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
    weight, bias = head.weight, head.bias
    if hasattr(weight, "full_tensor"):  # FSDP2 DTensor: gather the head, as TRL's fused head does
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None and hasattr(bias, "full_tensor") else bias
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
        """Per-token scores ``[B, T]`` of the completion tokens: TRL's model call (its fused head; labels all
        ignored when the replay recomputes the head) with the backbone's last hidden state captured, then the
        replayed log-probs and the top-k bounds from it, chunked. ``compute_entropy``: the entropy of the
        distribution the tokens are scored under (TRL's fused head's, or on the replayed support), with a
        gradient only when TRL's entropy bonus is on."""
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
            if recipe is not None:
                # the replay recomputes the head: the model's own forward with one position's logits (TRL's
                # fused head would score every position off CUDA, where it does not drop the ignored labels)
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
            y = targets.reshape(-1)[rows]
            n_all = valid.numel()
            if recipe is not None:
                history = None
                if recipe.reads_history:
                    # HF generate's repetition penalty sees the left-padded prompt (pad tokens too); vLLM
                    # sees the prompt alone
                    prompt, seen = ids[:, :-t_len], att[:, :-t_len].bool()
                    if self.offpolicy_order != ENGINE_ORDERS["vllm"]:
                        seen = torch.ones_like(seen)
                    prompts = [p[k].tolist() for p, k in zip(prompt, seen)]
                    history = ReplayHistory(prompts, targets, valid, rows)
                r = replay_logp(h, weight, y, recipe, order=self.offpolicy_order, bias=bias, history=history,
                                memory_budget_bytes=self.offpolicy_budget)
                logp = r.logp.new_zeros(n_all).index_copy(0, rows, r.logp).reshape(valid.shape)
                inside = torch.ones(n_all, dtype=torch.bool, device=ids.device).index_copy(0, rows, r.inside)
                mass = torch.ones(n_all, device=ids.device).index_copy(0, rows, r.mass.float())
                inside, mass = inside.reshape(valid.shape), mass.reshape(valid.shape)
                entropy = None
                if compute_entropy:  # the bonus differentiates it; the metric and the quantile mask do not
                    with torch.set_grad_enabled(torch.is_grad_enabled() and self._offpolicy_entropy_grad()):
                        e = replay_entropy(h, weight, recipe, order=self.offpolicy_order, bias=bias,
                                           history=history, memory_budget_bytes=self.offpolicy_budget)
                    entropy = e.new_zeros(n_all).index_copy(0, rows, e).reshape(valid.shape)
            else:
                logp = out.log_probs[:, -t_len:]
                inside = torch.ones_like(valid)
                mass = torch.ones(valid.shape, device=ids.device)
                entropy = out.entropy[:, -t_len:] if compute_entropy else None
            lower = upper = center = own = None
            if topk is not None and topk[0] is not None:
                topk_ids = topk[1]
                assert topk_ids is not None  # stored with the log-probs (_generate_single_turn)
                lp_k = topk[0][start:start + batch_size].reshape(n_all, -1)[rows]
                id_k = topk_ids[start:start + batch_size].reshape(n_all, -1)[rows]
                temperature = float(getattr(self.args, "temperature", 1.0) or 1.0)
                lo, up = topk_divergence(h.detach(), weight.detach(), lp_k, id_k,
                                         bias=None if bias is None else bias.detach(), temperature=temperature,
                                         memory_budget_bytes=self.offpolicy_budget)
                lower = lo.new_zeros(n_all).index_copy(0, rows, lo).reshape(valid.shape)
                upper = up.new_zeros(n_all).index_copy(0, rows, up).reshape(valid.shape)
                if self.offpolicy_score_centering:  # differentiable: the update forward's centre
                    c = topk_score_center(h, weight, lp_k, id_k, bias=bias, temperature=temperature,
                                          memory_budget_bytes=self.offpolicy_budget)
                    center = c.new_zeros(n_all).index_copy(0, rows, c).reshape(valid.shape)
                if start == 0 and self._offpolicy_advice_ks and torch.is_grad_enabled():  # first update only
                    own = own_slack_rows(h.detach(), weight.detach(), rows, (valid.shape[0], valid.shape[1]),
                                         self._offpolicy_advice_ks, bias=None if bias is None else bias.detach(),
                                         temperature=temperature, memory_budget_bytes=self.offpolicy_budget)
            parts.append(Scores(logp, inside, mass, lower, upper, getattr(out, "aux_loss", None), center,
                                own if start == 0 and topk is not None else None, entropy))

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
                      cat("kl_upper"), aux, cat("center"), parts[0].own_slack, cat("entropy"))

    def _offpolicy_entropy_grad(self) -> bool:
        """TRL's entropy bonus is on (static ``entropy_coef`` ≠ 0 or adaptive): the entropy needs its gradient."""
        return bool(getattr(self, "_entropy_bonus_enabled", False))
