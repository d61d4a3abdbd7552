"""The token format shared with the models: one joint id space for source and target.

``PAD=0, BOS=1, EOS=2, UNK=3``; padding masks follow the ``tokens != PAD_ID`` convention
(True where there is a real token).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


def padding_mask(tokens: torch.Tensor) -> torch.Tensor:
    """Boolean mask, True at real tokens and False at padding: ``tokens != PAD_ID``."""
    return tokens != PAD_ID


def strip_special(ids: Iterable[int]) -> list[int]:
    """Ids up to the first EOS, without PAD and BOS (UNK is kept)."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS_ID:
            break
        if i not in (PAD_ID, BOS_ID):
            out.append(i)
    return out


class WordVocabulary:
    """A word-level vocabulary: the four special tokens, then ``words`` in the given order.

    Raises:
        ValueError: if ``words`` holds a duplicate or a special token.
    """

    def __init__(self, words: Sequence[str]) -> None:
        self.tokens = list(SPECIAL_TOKENS) + list(words)
        self.index = {w: i for i, w in enumerate(self.tokens)}
        if len(self.index) != len(self.tokens):
            raise ValueError("words must be unique and must not repeat a special token")

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, text: str | Sequence[str]) -> list[int]:
        """Ids of the words of ``text`` (a string split on whitespace, or a word list); unknown → UNK."""
        words = text.split() if isinstance(text, str) else text
        return [self.index.get(w, UNK_ID) for w in words]

    def decode(self, ids: Iterable[int]) -> str:
        """Detokenized text: words joined by spaces, stopping at the first EOS, skipping PAD/BOS."""
        return " ".join(self.tokens[i] if i < len(self.tokens) else SPECIAL_TOKENS[UNK_ID] for i in strip_special(ids))
