"""Sampling configuration and logit processing: the *processed* distribution a rollout engine samples from.

The behaviour policy μ of an RL rollout is not the model's softmax but the distribution after every logits processor
the engine applied. vLLM returns exactly this with ``logprobs_mode="processed_logprobs"``; HF's ``generate`` applies
the same processors. Importance ratios must compare the trainer's log-probs against *this* μ, processed the same way
on the trainer side, otherwise the processing itself shows up as (large, biased) "mismatch" (DVP §3; DeepSeek-V3.2
"keep sampling mask"; TRL can only warn about the penalties it does not replay: its issues 6789, 6880, 6944).

The recipe (:class:`SamplingConfig`) and its order — :func:`process_logits` applies, on float32 logits:

1. ``bad_words_ids``: a one-token word is always banned (−inf); a longer word bans its last token where the tokens
   before the position end with the rest of it (prompt and completion alike) — HF's ``NoBadWordsLogitsProcessor``.
2. ``logit_bias``: z_a += b_a — vLLM's ``logit_bias``, HF's ``sequence_bias`` with one-token keys.
3. ``repetition_penalty`` r: for every token in the prompt or earlier in the completion, z > 0 → z / r, else z · r —
   HF's ``RepetitionPenaltyLogitsProcessor`` and vLLM's repetition penalty (the same definition; CTRL,
   arXiv 1909.05858).
4. ``frequency_penalty`` f and ``presence_penalty`` q: z_a −= f · n_a + q · [n_a > 0] with n_a the count of a among
   the *completion's* earlier tokens (not the prompt's) — vLLM's definition, which is OpenAI's; HF has neither.
5. ``temperature``: z / T (a vLLM engine reports the temperature after its floor of 0.01).
6. ``top_k`` → ``top_p`` → ``min_p``: HF's warper order (vLLM applies min-p first; its engine here refuses min-p
   together with top-p).

Steps 1–4 are in this order in vLLM (bad words, logit bias, then its ``apply_penalties``: repetition, frequency,
presence) and in HF (``sequence_bias``, repetition, bad words: a banned −inf is unchanged by the others), so every
processor matches both engines that have it. Steps 1, 3 and 4 read the token history (:class:`TokenHistory`): the
prompt and the completion tokens before the position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor


def _check_tokens(name: str, ids: object) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{name} must be a sequence of token ids, got {ids!r}")
    out = tuple(ids)
    if not out or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in out):
        raise ValueError(f"{name} must be a non-empty sequence of token ids >= 0, got {ids!r}")
    return out


@dataclass(frozen=True)
class SamplingConfig:
    """How a rollout engine samples — the full recipe of logits processors; validated on construction
    (``ValueError`` naming the argument). See the module docstring for each processor's definition and order.

    ``logprobs_topk`` = K > 0 also returns the K most likely processed log-probs (and ids) at every step — what
    TRM's exact-KL fallback and sampling-support replay need. ``logit_bias`` takes a ``{token_id: bias}`` dict (stored
    as sorted pairs); ``bad_words_ids`` a list of token-id lists.

    >>> SamplingConfig(temperature=0.7, top_p=0.9).top_p
    0.9
    >>> SamplingConfig(repetition_penalty=1.2, logit_bias={5: -1.0}).processors
    ('logit_bias', 'repetition_penalty')
    >>> SamplingConfig(top_k=0)
    Traceback (most recent call last):
    ...
    ValueError: top_k must be None or an int >= 1, got 0
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    logprobs_topk: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    bad_words_ids: tuple[tuple[int, ...], ...] = field(default=())

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite float > 0, got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be None or in (0, 1], got {self.top_p!r}")
        if self.min_p is not None and not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be None or in [0, 1], got {self.min_p!r}")
        if isinstance(self.logprobs_topk, bool) or not isinstance(self.logprobs_topk, int) or self.logprobs_topk < 0:
            raise ValueError(f"logprobs_topk must be an int >= 0, got {self.logprobs_topk!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
            raise ValueError(f"repetition_penalty must be a finite float > 0, got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite float, got {v!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            pairs = tuple(sorted((k, float(b)) for k, b in bias))
        except (TypeError, ValueError) as err:
            raise ValueError(f"logit_bias must map token ids >= 0 to finite floats, got {self.logit_bias!r}") from err
        ids = [k for k, _ in pairs]
        if (any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in ids) or len(set(ids)) != len(ids)
                or any(not math.isfinite(b) for _, b in pairs)):
            raise ValueError(f"logit_bias must map distinct token ids >= 0 to finite floats, got {self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", pairs)
        if isinstance(self.bad_words_ids, (str, bytes)) or not hasattr(self.bad_words_ids, "__iter__"):
            raise ValueError(f"bad_words_ids must be a list of token-id lists, got {self.bad_words_ids!r}")
        object.__setattr__(self, "bad_words_ids", tuple(_check_tokens("bad_words_ids entries", w)
                                                        for w in self.bad_words_ids))

    @property
    def processors(self) -> tuple[str, ...]:
        """The processors this recipe turns on, in the order they are applied (temperature 1 is off)."""
        on = {
            "bad_words": bool(self.bad_words_ids),
            "logit_bias": bool(self.logit_bias),
            "repetition_penalty": self.repetition_penalty != 1.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "temperature": self.temperature != 1.0,
            "top_k": self.top_k is not None,
            "top_p": self.top_p is not None and self.top_p < 1.0,
            "min_p": self.min_p is not None and self.min_p > 0.0,
        }
        return tuple(name for name, active in on.items() if active)

    @property
    def reads_history(self) -> tuple[str, ...]:
        """The active processors that read the token history (penalties; bad words longer than one token)."""
        names: list[str] = [n for n in ("repetition_penalty", "frequency_penalty", "presence_penalty")
                            if n in self.processors]
        if any(len(w) > 1 for w in self.bad_words_ids):
            names.insert(0, "bad_words")
        return tuple(names)


@dataclass
class TokenHistory:
    """What the history-reading processors see before each position (leading dims ``...`` = [B] for one decoding
    step, [B, T] for every completion position at once):

    * ``prompt_seen`` ``[..., V]`` bool (or broadcastable, e.g. [B, 1, V]): the token occurs in the prompt;
    * ``output_counts`` ``[..., V]`` float32: how often the token occurs among the completion's earlier tokens;
    * ``context`` ``[..., W]`` long or None: the last W tokens (prompt then completion) before the position, −1
      where the sequence is shorter — for bad words of up to W + 1 tokens.

    Build it with :func:`completion_history` (scoring) or :meth:`start` / :meth:`advance` (a decoding loop).
    """

    prompt_seen: Tensor
    output_counts: Tensor
    context: Tensor | None = None

    @staticmethod
    def start(prompt_ids: list[list[int]], vocab_size: int, cfg: SamplingConfig,
              device: torch.device | str = "cpu") -> TokenHistory:
        """The history before the first completion token of each prompt ([B] leading dims)."""
        b = len(prompt_ids)
        seen = torch.zeros(b, vocab_size, dtype=torch.bool, device=device)
        for i, p in enumerate(prompt_ids):
            seen[i, torch.as_tensor(list(p), dtype=torch.long, device=device)] = True
        width = _context_width(cfg)
        context = None
        if width:
            context = torch.full((b, width), -1, dtype=torch.long, device=device)
            for i, p in enumerate(prompt_ids):
                tail = list(p)[-width:]
                context[i, width - len(tail):] = torch.as_tensor(tail, dtype=torch.long, device=device)
        return TokenHistory(seen, torch.zeros(b, vocab_size, device=device), context)

    def chunk(self, a: int, b: int, vocab: int) -> TokenHistory:
        """Rows ``a:b`` of this history with its leading dims flattened (``[B, T]`` → ``[B·T]``, row-major): what
        :func:`offpolicy.forward_scores.token_scores` reads per row chunk (``vocab``: the logits' V, checked)."""
        lead = self.output_counts.shape[:-1]
        if self.output_counts.shape[-1] != vocab:
            raise ValueError(f"history: built for a vocabulary of {self.output_counts.shape[-1]}, the logits have {vocab}")
        rows = torch.arange(a, b, device=self.output_counts.device)
        index = torch.unravel_index(rows, tuple(lead))  # a broadcast dim of prompt_seen ([B, 1, V]) reads index 0
        seen = self.prompt_seen[tuple(i if n > 1 else torch.zeros_like(i)
                                      for i, n in zip(index, self.prompt_seen.shape[:-1]))]
        context = self.context.reshape(-1, self.context.shape[-1])[a:b] if self.context is not None else None
        return TokenHistory(seen, self.output_counts.reshape(-1, vocab)[a:b], context)

    def advance(self, tokens: Tensor, valid: Tensor) -> None:
        """Append the sampled ``tokens`` [B] of the rows where ``valid`` [B] is True (in place)."""
        self.output_counts.scatter_add_(-1, tokens[:, None].long(), valid[:, None].float())
        if self.context is not None:
            shifted = torch.cat([self.context[:, 1:], tokens[:, None].long()], dim=-1)
            self.context = torch.where(valid[:, None], shifted, self.context)


# process_logits's truncation order after steps 1–4 (HF's warpers), as sampling_support_mask names the steps
TRUNCATION_ORDER: tuple[str, ...] = ("top_k", "top_p", "min_p")


def _context_width(cfg: SamplingConfig) -> int:
    return max((len(w) - 1 for w in cfg.bad_words_ids), default=0)


def completion_history(prompt_ids: list[list[int]], completion_ids: list[list[int]], vocab_size: int,
                       cfg: SamplingConfig, device: torch.device | str = "cpu") -> TokenHistory:
    """:class:`TokenHistory` for every completion position ``[B, T]`` at once (T = longest completion): position t
    of row i sees the prompt and ``completion_ids[i][:t]`` — what a decoding loop saw when it sampled token t.

    >>> h = completion_history([[3]], [[1, 1, 2]], 4, SamplingConfig(frequency_penalty=1.0))
    >>> h.output_counts[0].tolist()   # before t = 0, 1, 2: nothing; one 1; two 1s
    [[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]]
    """
    b, t = len(completion_ids), max((len(c) for c in completion_ids), default=0)
    seen = TokenHistory.start(prompt_ids, vocab_size, SamplingConfig(), device).prompt_seen[:, None, :]
    ids = torch.full((b, t), vocab_size, dtype=torch.long, device=device)  # id V = padding, dropped below
    for i, c in enumerate(completion_ids):
        if c:
            ids[i, : len(c)] = torch.as_tensor(list(c), dtype=torch.long, device=device)
    one_hot = torch.zeros(b, t, vocab_size + 1, device=device).scatter_(-1, ids[..., None], 1.0)[..., :vocab_size]
    counts = one_hot.cumsum(dim=1) - one_hot  # exclusive: the tokens before t
    width = _context_width(cfg)
    context = None
    if width:
        rows = [[-1] * width + list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
        full = torch.full((b, max(len(r) for r in rows) + t), -1, dtype=torch.long, device=device)
        for i, r in enumerate(rows):
            full[i, : len(r)] = torch.as_tensor(r, dtype=torch.long, device=device)
        # the W tokens before completion position t of row i sit at [P_i + t, P_i + t + W) in the −1-padded row
        start = torch.tensor([len(p) for p in prompt_ids], device=device)[:, None] + torch.arange(t, device=device)
        index = start[..., None] + torch.arange(width, device=device)
        context = torch.gather(full, 1, index.reshape(b, -1)).reshape(b, t, width)
    return TokenHistory(seen, counts, context)


def apply_history_processors(x: Tensor, cfg: SamplingConfig, history: TokenHistory | None) -> Tensor:
    """Steps 1–4 of the recipe (bad words, logit bias, repetition / frequency / presence penalties) on float32
    logits ``[..., V]``; differentiable in ``x`` (where, multiply, subtract)."""
    needs = cfg.reads_history
    if needs and history is None:
        raise ValueError(f"{needs[0]} reads the token history (the prompt and the earlier completion tokens): pass "
                         "history= (offpolicy.rollout.sampling.completion_history for scoring)")
    if not (cfg.bad_words_ids or cfg.logit_bias or needs):
        return x
    vocab = x.shape[-1]
    used = [k for k, _ in cfg.logit_bias] + [t for w in cfg.bad_words_ids for t in w]
    if used and max(used) >= vocab:
        raise ValueError(f"logit_bias / bad_words_ids name token id {max(used)}, outside the vocabulary of {vocab}")
    neg_inf = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)
    vocab_ids = torch.arange(vocab, device=x.device)
    for word in cfg.bad_words_ids:
        banned = vocab_ids == word[-1]
        if len(word) > 1:
            # a bad word longer than one token reads the history (checked above)
            assert history is not None and history.context is not None
            prefix = torch.tensor(word[:-1], device=x.device)
            banned = banned & (history.context[..., -len(prefix):] == prefix).all(-1, keepdim=True)
        x = torch.where(banned, neg_inf, x)
    if cfg.logit_bias:
        bias = torch.zeros(vocab, dtype=x.dtype, device=x.device)
        ids, values = zip(*cfg.logit_bias)
        bias[torch.tensor(ids, device=x.device)] = torch.tensor(values, dtype=x.dtype, device=x.device)
        x = x + bias
    if history is not None and cfg.reads_history:
        counts = history.output_counts.to(x.dtype)
        in_output = (counts > 0).to(x.dtype)
        if cfg.repetition_penalty != 1.0:
            seen = history.prompt_seen | (counts > 0)
            r = cfg.repetition_penalty
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        if cfg.frequency_penalty != 0.0:
            x = x - cfg.frequency_penalty * counts
        if cfg.presence_penalty != 0.0:
            x = x - cfg.presence_penalty * in_output
    return x


def process_logits(logits: Tensor, cfg: SamplingConfig | None = None, history: TokenHistory | None = None) -> Tensor:
    """Processed sampling log-probs ``[..., V]`` (float32) from raw logits ``[..., V]``: the recipe of the module
    docstring, then ``log_softmax``. ``cfg=None`` means plain ``log_softmax``. ``history`` (a :class:`TokenHistory`
    with the same leading dims) is required when the recipe has penalties or multi-token bad words.

    Truncation tie rules follow HF's logits warpers (and vLLM's sampler): top-k keeps every token whose logit is ≥
    the k-th largest; top-p keeps the smallest most-likely set with mass ≥ p (the token that crosses p is kept, at
    least one token always); min-p keeps p(a) ≥ min_p · max_b p(b). Removed tokens get −inf.

    No host sync and no branching on tensor values (config branches only), so it compiles with fullgraph.

    >>> z = torch.tensor([2.0, 1.0, 0.0, -1.0])
    >>> process_logits(z, SamplingConfig(top_k=2)).exp()  # softmax of [2, 1]: e/(e+1), 1/(e+1)
    tensor([0.7311, 0.2689, 0.0000, 0.0000])
    """
    x = logits.float()
    if cfg is None:
        return torch.log_softmax(x, dim=-1)
    x = apply_history_processors(x, cfg, history)
    if cfg.temperature != 1.0:
        x = x / cfg.temperature
    neg_inf = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)
    if cfg.top_k is not None and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = torch.where(x < kth, neg_inf, x)
    if cfg.top_p is not None and cfg.top_p < 1.0:
        # Ascending sort: drop a token iff the mass at or below it is ≤ 1 − top_p (HF / vLLM formula).
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= 1.0 - cfg.top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = torch.where(drop, neg_inf, x)
    if cfg.min_p is not None and cfg.min_p > 0.0:
        # p(a) ≥ min_p · p_max  ⇔  z_a ≥ z_max + log(min_p)  (the normaliser cancels)
        z_max = x.max(dim=-1, keepdim=True).values
        x = torch.where(x < z_max + math.log(cfg.min_p), neg_inf, x)
    return torch.log_softmax(x, dim=-1)


SAMPLERS = ("inverse_cdf", "multinomial")


def sample_tokens(logp: Tensor, generator: torch.Generator | None = None, method: str = "inverse_cdf") -> Tensor:
    """Draw one token per row from processed log-probs ``[B, V]`` → ids ``[B]`` (int64), seeded by ``generator``.

    ``method``:

    * ``inverse_cdf`` — one uniform per row: u ~ U[0, S) with S = Σ_a p_a, and the first id whose running sum
      c_a = Σ_{b ≤ a} p_b exceeds u, so P(a) = (c_a − c_{a−1}) / S = p_a / S. The running sum and u are float64:
      each c_a carries ~1e-16 of rounding, so every p_a ≥ 1e-12 is drawn at its own rate to < 1e-4 relative (a
      float32 sum would blur the tail tokens this project studies), and a token with p_a = 0 (a −inf log-prob)
      never, its running sum being its predecessor's. One random draw per row.
    * ``multinomial`` — ``torch.multinomial``: an exponential race, one Exp(1) draw per vocabulary entry (what HF's
      ``generate`` does; ~18× slower on a CPU core for 32 × 4,099, where it was a sixth of a trainer step).

    Both are exact samplers of p; they use the generator differently, so a seed draws other tokens under each.

    >>> g = torch.Generator().manual_seed(0)
    >>> sample_tokens(torch.log(torch.tensor([[0.0, 1.0, 0.0]])), g)
    tensor([1])
    """
    if method == "multinomial":
        return torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    if method != "inverse_cdf":
        raise ValueError(f"method must be one of {SAMPLERS}, got {method!r}")
    u = torch.rand((logp.shape[0], 1), generator=generator, dtype=torch.float64, device=logp.device)
    return inverse_cdf(logp.exp(), u)


def inverse_cdf(p: Tensor, u: Tensor) -> Tensor:
    """The id a uniform ``u`` ``[B, 1]`` in [0, 1) picks from unnormalised probabilities ``p`` ``[B, V]`` → ``[B]``:
    the first a with c_a > u · S, where c_a = Σ_{b ≤ a} p_b and S = c_{V−1}, both in float64.

    >>> p = torch.tensor([[0.5, 0.0, 0.25, 0.25]])  # c = (0.5, 0.5, 0.75, 1.0)
    >>> [int(inverse_cdf(p, torch.tensor([[x]], dtype=torch.float64))) for x in (0.0, 0.5, 0.74, 0.75)]
    [0, 2, 2, 3]
    """
    cdf = p.double().cumsum(-1)
    total = cdf[:, -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise ValueError("logp: a row has no finite, positive probability mass (NaN or +inf logits?)")
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # u·S may round up to S itself
    return torch.searchsorted(cdf, x, right=True).squeeze(-1)


def topk_logprobs(logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest processed log-probs and their ids, ``[..., k]`` each (−inf where fewer than k survive).

    >>> topk_logprobs(torch.tensor([[-2.0, -0.5, -1.0]]), 2)
    (tensor([[-0.5000, -1.0000]]), tensor([[1, 2]]))
    """
    values, ids = torch.topk(logp, k, dim=-1)
    return values, ids
