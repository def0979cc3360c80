"""A greedy longest-match tokenizer over a hand-written vocabulary: drift in a conversation is known by hand.

Its vocabulary merges ``")="`` and ``"= 8"``, so ``"= 84"`` tokenized alone is ``["= 8", "4"]`` while after a ``")"``
the same text re-tokenizes as ``[")=", " ", "8", "4"]`` — the ``)`` of the previous turn and the tool's ``=`` merge
across the boundary. Special tokens (``<pad>``, ``<bos>``, ``<eos>``) are matched whole; ``add_special_tokens`` puts
``<bos>`` in front (offset ``(0, 0)``). The interface is the part of a transformers tokenizer the multi-turn rollout
uses: ``__call__`` (``input_ids``, ``offset_mapping``), ``decode``, ``eos_token`` / ``eos_token_id``,
``convert_ids_to_tokens``.
"""

from __future__ import annotations

SPECIALS = ("<pad>", "<bos>", "<eos>")
PIECES = tuple("0123456789") + tuple("calc()*+-= \n") + (")=", "= 8", "calc", "\n=")


class ToyTokenizer:
    def __init__(self, pieces: tuple[str, ...] = PIECES) -> None:
        self.vocab = list(SPECIALS) + list(dict.fromkeys(pieces))
        self.ids = {p: i for i, p in enumerate(self.vocab)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self.eos_token = "<eos>"

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids, offsets, i = [], [], 0
        while i < len(text):
            special = next((s for s in SPECIALS if text.startswith(s, i)), None)
            piece = special or max((p for p in self.vocab[len(SPECIALS):] if text.startswith(p, i)), key=len,
                                   default=None)
            if piece is None:
                raise ValueError(f"text: no piece for {text[i]!r} at {i}")
            ids.append(self.ids[piece])
            offsets.append((i, i + len(piece)))
            i += len(piece)
        return ids, offsets

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False) -> dict:
        ids, offsets = self.encode(text)
        if add_special_tokens:
            ids, offsets = [self.bos_token_id, *ids], [(0, 0), *offsets]
        out: dict = {"input_ids": ids}
        if return_offsets_mapping:
            out["offset_mapping"] = offsets
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and i < len(SPECIALS)))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.vocab[i] for i in ids]

    def tokens(self, *pieces: str) -> tuple[int, ...]:
        """The ids of the given pieces (a hand-written tokenization, canonical or not)."""
        return tuple(self.ids[p] for p in pieces)
