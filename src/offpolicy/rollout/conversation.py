"""A multi-turn conversation as the engine saw it, and the two ways a trainer can turn it back into token ids.

A :class:`Conversation` is a list of :class:`Segment` s — the prompt, then policy turns and the environment's (tool)
answers in turn — each with the ids the engine consumed or sampled. The trainer needs one id sequence per row to score
and a loss mask; :func:`trainer_view` builds it in one of two modes:

* ``"engine"`` (token-in, token-out): the concatenation of the segments' own ids — the engine's sampled ids and the
  tool text's ids as tokenized once, on its own, before the engine read them. The trainer scores exactly the tokens
  the engine sampled from, so μ and π_old are log-probs of the same tokens in the same context.
* ``"retokenize"``: the conversation's *text* (policy turns decoded, special tokens skipped, the end-of-turn token
  written out as a chat template does; the tool's text as it is) tokenized again as one string. A BPE merges across a
  segment boundary, or canonicalises a token split the policy sampled (``"ba" "zo"`` → ``"bazo"``), so the ids can
  differ from the engine's — retokenization drift (:mod:`offpolicy.rollout.turn_drift` measures it). μ is then matched
  to the re-tokenized tokens by position within each policy turn, as a pipeline that keeps the engine's per-turn
  log-prob lists and re-tokenizes the text does; a token with no engine log-prob at its position is left out of the
  loss, and so is a token that straddles two segments.

In both modes tool tokens (and the prompt) never enter the loss: the policy did not sample them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["prompt", "policy", "tool"]
MODES = ("engine", "retokenize")


@dataclass(frozen=True)
class Segment:
    """One piece of a conversation: ``ids`` as the engine consumed (prompt, tool) or sampled (policy) them, ``text``
    as the conversation's text writes it, and for a policy turn the engine's processed log-probs ``logp`` (one per
    id, μ)."""

    role: Role
    ids: tuple[int, ...]
    text: str
    logp: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.role == "policy" and len(self.logp) != len(self.ids):
            raise ValueError(f"logp: a policy segment needs one log-prob per id, got {len(self.logp)} for "
                             f"{len(self.ids)} ids")


@dataclass(frozen=True)
class Conversation:
    """Segments in order; the first is the prompt. ``texts`` are the policy turns' decoded texts (special tokens
    skipped) — what the environment and the reward read."""

    segments: tuple[Segment, ...]
    texts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.segments or self.segments[0].role != "prompt":
            raise ValueError("segments: a conversation starts with its prompt segment")

    @property
    def text(self) -> str:
        """The whole conversation as one string (what a retokenizing trainer tokenizes)."""
        return "".join(s.text for s in self.segments)

    def spans(self) -> list[tuple[int, int]]:
        """Each segment's ``[start, end)`` character span in :attr:`text`."""
        out, start = [], 0
        for s in self.segments:
            out.append((start, start + len(s.text)))
            start += len(s.text)
        return out

    @property
    def policy_turns(self) -> list[int]:
        """Indices of the policy segments, in order."""
        return [k for k, s in enumerate(self.segments) if s.role == "policy"]


def render_turn(tokenizer: Any, ids: list[int]) -> tuple[str, str]:
    """A sampled turn's ``(decoded, rendered)`` text: decoded with special tokens skipped (what the environment and
    the reward read), and rendered into the conversation — the decoded text plus the end-of-turn token's own string
    when the turn ended with it (as a chat template writes ``<|im_end|>`` after a message)."""
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    eos = getattr(tokenizer, "eos_token_id", None)
    ended = eos is not None and len(ids) > 0 and ids[-1] == eos
    return decoded, decoded + (tokenizer.eos_token if ended else "")


@dataclass
class Retokenized:
    """The conversation's text tokenized again: ``ids`` and, per token, the index of the segment its characters lie
    in (``segment``; −1 for a token that straddles a boundary)."""

    ids: list[int]
    segment: list[int]


def retokenize(conversation: Conversation, tokenizer: Any) -> Retokenized:
    """Tokenize ``conversation.text`` as one string (with the tokenizer's own special tokens, e.g. bos) and assign
    each token to the segment that holds its character span (tokenizer offsets). An empty span (a template's bos)
    belongs to the first segment that reaches its position (bos at 0: the prompt, even an empty one).

    >>> from offpolicy.models.tokenizer import build_tokenizer
    >>> tok = build_tokenizer()
    >>> # the policy wrote "se", the tool answered "vu": in one string they merge into one token, "sevu"
    >>> conv = Conversation((Segment("prompt", (1, 25, 31), "7="), Segment("policy", (264,), "se", (-1.0,)),
    ...                      Segment("tool", (274,), "vu")))
    >>> r = retokenize(conv, tok)
    >>> tok.convert_ids_to_tokens(r.ids), r.segment
    (['<|bos|>', '7', '=', 'sevu'], [0, 0, 0, -1])
    """
    enc = tokenizer(conversation.text, return_offsets_mapping=True)
    spans = conversation.spans()
    segment = []
    for a, b in enc["offset_mapping"]:
        if a == b:
            inside = [k for k, (s, e) in enumerate(spans) if s <= a <= e]  # the first segment reaching it
        else:
            inside = [k for k, (s, e) in enumerate(spans) if s <= a and b <= e]
        segment.append(inside[0] if inside else -1)
    return Retokenized(list(enc["input_ids"]), segment)


@dataclass
class TrainerView:
    """One conversation as the trainer scores it. Per completion position (all lists have the completion's length):
    ``segment`` (the conversation segment the token lies in, −1: straddles a boundary), ``turn`` (0-based policy
    turn, −1: not a policy token), ``first`` (the first token of its policy turn), ``loss`` (enters the loss),
    ``rollout_logp`` (μ, 0 where ``loss`` is False). ``prompt_segment_ids``: the ids of the prompt part."""

    prompt_ids: list[int]
    completion_ids: list[int]
    segment: list[int]
    turn: list[int]
    first: list[bool]
    loss: list[bool]
    rollout_logp: list[float]
    mode: str = "engine"
    unaligned: int = 0  # policy tokens with no engine log-prob at their position (retokenize mode)
    extra: dict[str, Any] = field(default_factory=dict)

    def segment_ids(self, k: int) -> list[int]:
        """The ids this view holds for conversation segment ``k`` (the prompt's for ``k`` = 0)."""
        if k == 0:
            return list(self.prompt_ids)
        return [i for i, s in zip(self.completion_ids, self.segment) if s == k]


def trainer_view(conversation: Conversation, mode: str, tokenizer: Any = None) -> TrainerView:
    """The ids, masks and μ the trainer uses for ``conversation`` in ``mode`` (``"engine"`` or ``"retokenize"``; see
    the module docstring). ``tokenizer`` is needed for ``"retokenize"``.

    >>> conv = Conversation((Segment("prompt", (1, 5), "p"), Segment("policy", (7, 2), "x", (-0.5, -0.1)),
    ...                      Segment("tool", (9, 9), "t"), Segment("policy", (8,), "y", (-0.2,))))
    >>> v = trainer_view(conv, "engine")
    >>> v.completion_ids, v.loss, v.turn, v.first, v.rollout_logp
    ([7, 2, 9, 9, 8], [True, True, False, False, True], [0, 0, -1, -1, 1], [True, False, False, False, True], [-0.5, -0.1, 0.0, 0.0, -0.2])
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    segs = conversation.segments
    turn_of = {k: t for t, k in enumerate(conversation.policy_turns)}
    if mode == "engine":
        ids: list[int] = []
        segment: list[int] = []
        position: list[int] = []
        for k, s in enumerate(segs[1:], start=1):
            ids += s.ids
            segment += [k] * len(s.ids)
            position += range(len(s.ids))
        prompt_ids = list(segs[0].ids)
    else:
        if tokenizer is None:
            raise ValueError("tokenizer: the retokenize mode needs the tokenizer")
        r = retokenize(conversation, tokenizer)
        n_prompt = 0  # the leading tokens inside the prompt's text are the prompt
        while n_prompt < len(r.ids) and r.segment[n_prompt] == 0:
            n_prompt += 1
        if n_prompt == 0:
            raise ValueError("conversation: its prompt re-tokenizes to no token of its own (merged into the first turn)")
        prompt_ids, ids, segment = r.ids[:n_prompt], r.ids[n_prompt:], r.segment[n_prompt:]
        seen: dict[int, int] = {}
        position = []
        for s_k in segment:
            position.append(seen.get(s_k, 0))
            seen[s_k] = position[-1] + 1
    turn, first, loss, mu = [], [], [], []
    unaligned = 0
    for s_k, j in zip(segment, position):
        policy = s_k in turn_of
        aligned = policy and j < len(segs[s_k].logp)
        unaligned += int(policy and not aligned)
        turn.append(turn_of[s_k] if policy else -1)
        first.append(bool(aligned and j == 0))
        loss.append(bool(aligned))
        mu.append(float(segs[s_k].logp[j]) if aligned else 0.0)
    return TrainerView(prompt_ids, list(ids), list(segment), turn, first, loss, mu, mode=mode, unaligned=unaligned)
