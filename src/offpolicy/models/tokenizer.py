"""The embedded tokenizer: a byte-level BPE built locally from a generated corpus (no download).

Why byte-level BPE: every string round-trips exactly (decode(encode(s)) == s), so task text, rewards and the
decoded completions agree. Digits are always split one per token (``Digits(individual_digits=True)``) so the
arithmetic task is compositional for a tiny model. The vocabulary is padded to ≥ 4096 entries with merges of
generated pseudo-words: the trained policy puts almost all of its mass on a few dozen tokens and leaves a real
long tail of thousands of tokens with tiny probability — the regime where bf16 rollouts disagree most with an
fp32 trainer (DVP, arXiv 2512.23087, Prop. 4.2).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
VOCAB_SIZE = 4096 + len(SPECIAL_TOKENS)

# Words the built-in tasks use, so their prompts encode into few tokens.
_TASK_WORDS = ("Use", "use", "to", "make", "numbers", "target", "answer", "plus", "minus", "times", "the", "and")
_SYLLABLES = tuple(c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou")


def _corpus(seed: int = 0, n_words: int = 6000) -> Iterator[str]:
    """Deterministic training text: task-like strings plus pseudo-words (so merges fill the vocabulary)."""
    rng = random.Random(seed)
    ops = "+-*/"
    for _ in range(2000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        yield f"{a}{rng.choice(ops)}{b}={a + b} ({a}) {b}"
    for _ in range(50):  # repeated so whole task words become single tokens
        yield " ".join(_TASK_WORDS) + " " + " ".join(f"{w} {rng.randint(0, 99)}" for w in _TASK_WORDS) + ":"
    for _ in range(n_words):
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
        yield f"{word} {word.capitalize()} {word},"


@functools.lru_cache(maxsize=4)
def _tokenizer_json(seed: int) -> str:
    """Train the BPE once per process (≈2 s) and keep its JSON; every caller gets a fresh tokenizer object."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tok.to_str()


def build_tokenizer(seed: int = 0):  # -> PreTrainedTokenizerFast
    """Build the embedded tokenizer (byte-level BPE, ``VOCAB_SIZE`` entries, pad/bos/eos specials).

    Encoding adds ``<|bos|>`` in front (a TemplateProcessing post-processor); ``decode(..., skip_special_tokens=True)``
    gives back the exact text. Deterministic given ``seed``.

    >>> tok = build_tokenizer()
    >>> len(tok) >= 4096, tok.decode(tok("12+34=")["input_ids"], skip_special_tokens=True)
    (True, '12+34=')
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(seed)),
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
