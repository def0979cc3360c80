"""Is TRM's certified top-k test informative at this K? A diagnostic, and the K (or threshold) that would make it so.

From the engine's top-K log-probs the certified upper bound on KL(μ‖π) (:func:`offpolicy.topk_kl_upper_bound`) is
the head's exact terms plus the worst tail μ could have — its rest mass q_R = 1 − Σ_top-K q_i, no token above the
K-th probability, placed on π's least likely tokens. The part of the bound that does not depend on the mismatch, the
*slack* upper − lower, is about q_R times a log-ratio of 10–20 nats. So the test is decided by K, not by the
mismatch, once q_R · 15 nats > δ: under live vLLM (bf16) on the embedded tiny model, top-8 leaves q_R ≈ 4 % of μ
outside and the bound averages 0.6 nats per token against an exact KL of 1e-4 — TRM-Max at δ = 0.05 keeps only the
≈ 40 % of tokens where μ is peaked, and TRM's average test at 0.001 nothing. At K = 20 the same bound averages
0.002 and every token passes δ = 0.05.

:func:`topk_advice` says this from the batch at hand: ``certifiable`` is the fraction of sequences the certified
test could keep *at best* — if the engine's head matched the trainer's exactly, the slack alone decides — and the
bound is *vacuous* when that is below one half: then what TRM drops says nothing about the mismatch. The suggested
K comes from the trainer's own distribution π standing in for μ (the two differ by a KL of ~1e-4, so their tails
are alike): π's own top-K' slack for K' = 2K, 4K, … up to the vocabulary, and the first K' at which 90 % of the
sequences become certifiable (:func:`own_topk_slack`). The other ways out: TRM-Max alone (``avg_kl=None``: the
average test needs the mean slack below δ_avg = 0.001, i.e. q_R below ~1e-4), or the coarse-grained lower bound
(``topk_bound="lower"``), which never rejects a sequence the exact test keeps but certifies nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.divergence import topk_kl_upper_bound
from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES
from offpolicy.ratios import nonfinite_rows, per_sequence

VACUOUS_BELOW = 0.5  # the bound is vacuous when it could certify fewer than half of the sequences
SUGGEST_AT = 0.9  # a suggested K makes at least this fraction of sequences certifiable (π standing in for μ)


@dataclass(frozen=True)
class TopKAdvice:
    """What :func:`topk_advice` found (means over the valid tokens; ``certifiable`` over the non-empty sequences)."""

    k: int
    max_kl: float | None
    avg_kl: float | None
    head_mass: float  # Σ of the engine's top-K probabilities
    slack: float  # upper − lower, nats per token: the price of not seeing μ's tail
    certifiable: float  # the fraction of sequences the certified test could keep at best
    suggested_k: int | None = None  # the smallest K' at which ≥ 90 % would be (None: not estimated or none found)
    suggested_k_max_only: int | None = None  # the same for the max test alone (avg_kl=None), when avg_kl is set
    certifiable_max_only: float | None = None  # what the max test alone could keep at this K, when avg_kl is set

    @property
    def vacuous(self) -> bool:
        return self.certifiable < VACUOUS_BELOW

    def message(self) -> str:
        """One paragraph for the user: what the bound can do at this K, and what to change.

        >>> print(TopKAdvice(8, 0.05, 0.001, 0.958, 0.58, 0.0, 2048, 32).message())  # doctest: +NORMALIZE_WHITESPACE
        TRM on the engine's top-8: the certified upper bound is vacuous here. The engine's top-8 holds 95.8 % of μ;
        the rest, placed where π is least likely, adds 0.58 nats per token to the bound whatever the mismatch, so
        the test (max_kl=0.05, avg_kl=0.001) could keep at most 0 % of the sequences. With the trainer's π standing
        in for μ, topk_logprobs=2048 would make 90 % certifiable. Or test the maximum only, avg_kl=None
        (topk_logprobs=32 would do for it), or use topk_bound='lower' (never rejects a sequence the exact test
        keeps, but certifies nothing).
        """
        state = "vacuous here" if self.vacuous else "informative here"
        text = (f"TRM on the engine's top-{self.k}: the certified upper bound is {state}. The engine's top-{self.k} "
                f"holds {100 * self.head_mass:.1f} % of μ; the rest, placed where π is least likely, adds "
                f"{self.slack:.2g} nats per token to the bound whatever the mismatch, so the test "
                f"(max_kl={self.max_kl}, avg_kl={self.avg_kl}) could keep at most {100 * self.certifiable:.0f} % of "
                "the sequences.")
        if not self.vacuous:
            return text
        if self.suggested_k is not None:
            text += (f" With the trainer's π standing in for μ, topk_logprobs={self.suggested_k} would make "
                     f"{100 * SUGGEST_AT:.0f} % certifiable.")
        else:
            text += " No larger K was estimated to help."
        if self.avg_kl is not None:
            alone = ""
            if self.certifiable_max_only is not None and self.certifiable_max_only >= VACUOUS_BELOW:
                alone = f" (at this K it could keep {100 * self.certifiable_max_only:.0f} %)"
            elif self.suggested_k_max_only is not None:
                alone = f" (topk_logprobs={self.suggested_k_max_only} would do for it)"
            text += f" Or test the maximum only, avg_kl=None{alone}, or use"
        else:
            text += " Or use"
        return text + " topk_bound='lower' (never rejects a sequence the exact test keeps, but certifies nothing)."


def certifiable_fraction(slack: Tensor, mask: Tensor, *, max_kl: float | None, avg_kl: float | None) -> float:
    """Fraction of the non-empty sequences of ``slack`` ``[B, T]`` (``mask`` True at valid tokens) whose max over
    valid tokens is ≤ ``max_kl`` and whose mean is ≤ ``avg_kl`` (None: that test off) — TRM's decision on the slack.

    >>> s = torch.tensor([[0.01, 0.02], [0.01, 0.9]]); m = torch.ones(2, 2, dtype=torch.bool)
    >>> certifiable_fraction(s, m, max_kl=0.05, avg_kl=None), certifiable_fraction(s, m, max_kl=0.05, avg_kl=0.01)
    (0.5, 0.0)
    """
    m = mask.bool()
    rows = m.any(dim=-1)
    if not bool(rows.any()):
        return 1.0
    ok = torch.ones_like(rows)
    unknown = nonfinite_rows(slack, m)  # a NaN / inf slack certifies nothing, as in TRM's own test
    if max_kl is not None:
        ok &= (per_sequence(slack, m, "max") <= max_kl) & ~unknown
    if avg_kl is not None:
        ok &= (per_sequence(slack, m, "mean") <= avg_kl) & ~unknown
    return float(ok[rows].float().mean())


@torch.no_grad()
def own_topk_slack(logits: Tensor, ks: Sequence[int], *, temperature: float = 1.0,
                   memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> Tensor:
    """``[len(ks), N]``: the certified upper bound on KL(π‖π) = 0 from π's own top-K' for each K' in ``ks`` — pure
    slack, what the bound would cost at K' if the engine's μ were the trainer's π. ``logits`` [N, V].

    >>> # π = (0.644, 0.237, 0.087, 0.032). K' = 1: the tail's 0.356 (≤ the cap 0.644) all on π = 0.032:
    >>> # 0.356 log(0.356/0.032) = 0.857; K' = 2: 0.119 log(0.119/0.032) = 0.157; K' = 3: one tail token, no slack
    >>> [round(v, 3) for v in own_topk_slack(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), [1, 2, 3])[:, 0].clamp(min=0).tolist()]
    [0.857, 0.157, 0.0]
    """
    z = logits.float() / temperature
    lp = z.log_softmax(dim=-1)
    out = []
    for k in ks:
        top = lp.topk(min(int(k), lp.shape[-1]), dim=-1)
        out.append(topk_kl_upper_bound(top.values, top.indices, z, memory_budget_bytes=memory_budget_bytes).float())
    return torch.stack(out) if out else z.new_zeros(0, z.shape[0])


def doubling_ks(k: int, vocab: int) -> list[int]:
    """2K, 4K, … below ``vocab``, then ``vocab``: the K' the suggestion tries.

    >>> doubling_ks(8, 100)
    [16, 32, 64, 100]
    """
    ks, k2 = [], 2 * max(int(k), 1)
    while k2 < vocab:
        ks.append(k2)
        k2 *= 2
    return [*ks, vocab]


def topk_advice(lower: Tensor, upper: Tensor, mask: Tensor, topk_logp: Tensor, *, max_kl: float | None,
                avg_kl: float | None, own_slack: Tensor | None = None, ks: Sequence[int] = ()) -> TopKAdvice:
    """The diagnostic of the module docstring for one batch: ``lower`` / ``upper`` ``[B, T]`` the top-K bounds,
    ``topk_logp`` ``[B, T, K]`` the engine's top-K log-probs, ``mask`` ``[B, T]`` the valid tokens, TRM's thresholds;
    ``own_slack`` ``[len(ks), b, T]`` (:func:`own_topk_slack` at the positions of the first b ≤ B sequences, any
    value at padding) gives the suggested K — for the test as configured and, if both thresholds are set, for the
    max test alone.

    >>> lo, up = torch.zeros(1, 2), torch.tensor([[0.3, 0.8]]); m = torch.ones(1, 2, dtype=torch.bool)
    >>> lp = torch.tensor([[[-0.1], [-0.2]]])
    >>> own = torch.tensor([[[0.2, 0.3]], [[0.01, 0.02]]])  # π's own slack at K' = 2 and 4
    >>> a = topk_advice(lo, up, m, lp, max_kl=0.05, avg_kl=None, own_slack=own, ks=[2, 4])
    >>> a.vacuous, a.certifiable, a.suggested_k, round(a.slack, 2)
    (True, 0.0, 4, 0.55)
    """
    m = mask.bool()
    if lower.shape != upper.shape or lower.shape != m.shape or topk_logp.shape[:-1] != m.shape:
        raise ValueError(f"topk_advice: lower {tuple(lower.shape)}, upper {tuple(upper.shape)}, mask "
                         f"{tuple(m.shape)} and topk_logp {tuple(topk_logp.shape)} must share [B, T]")
    slack = (upper.float() - lower.float()).clamp(min=0.0)
    n = m.sum().clamp(min=1)
    head = topk_logp.float().exp().sum(dim=-1)
    certifiable = certifiable_fraction(slack, m, max_kl=max_kl, avg_kl=avg_kl)
    suggested = suggested_max = None
    if own_slack is not None:
        b = own_slack.shape[1] if own_slack.dim() == 3 else -1
        if own_slack.dim() != 3 or own_slack.shape[0] != len(ks) or not 0 < b <= m.shape[0] \
                or own_slack.shape[2] != m.shape[1]:
            raise ValueError(f"own_slack must be [len(ks)={len(ks)}, b ≤ {m.shape[0]}, {m.shape[1]}] (the first b "
                             f"sequences), got {tuple(own_slack.shape)}")
        suggested = _first_k(own_slack, m[:b], ks, max_kl, avg_kl)
        if avg_kl is not None and max_kl is not None:
            suggested_max = _first_k(own_slack, m[:b], ks, max_kl, None)
    max_only = certifiable_fraction(slack, m, max_kl=max_kl, avg_kl=None) \
        if avg_kl is not None and max_kl is not None else None
    return TopKAdvice(k=int(topk_logp.shape[-1]), max_kl=max_kl, avg_kl=avg_kl,
                      head_mass=float((head * m).sum() / n), slack=float((slack * m).sum() / n),
                      certifiable=certifiable, suggested_k=suggested, suggested_k_max_only=suggested_max,
                      certifiable_max_only=max_only)


def _first_k(own_slack: Tensor, mask: Tensor, ks: Sequence[int], max_kl: float | None,
             avg_kl: float | None) -> int | None:
    for k2, s in zip(ks, own_slack):
        if certifiable_fraction(s, mask, max_kl=max_kl, avg_kl=avg_kl) >= SUGGEST_AT:
            return int(k2)
    return None
