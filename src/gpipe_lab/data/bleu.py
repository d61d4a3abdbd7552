"""Detokenized corpus BLEU with sacrebleu (one reference stream)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sacrebleu.metrics import BLEU


@dataclass(frozen=True)
class BleuScore:
    """``score`` in [0, 100] and sacrebleu's ``signature`` (how the score was computed)."""

    score: float
    signature: str


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str], tokenize: str = "13a") -> BleuScore:
    """Corpus BLEU of detokenized ``hypotheses`` against one stream of detokenized ``references``.

    Calls ``BLEU(tokenize=...).corpus_score(hypotheses, [references])``: sacrebleu takes a
    *list of reference streams*, and a flat list or bare string would score silently wrong.

    Raises:
        TypeError: if ``hypotheses`` or ``references`` is a bare string.
        ValueError: if the two lists differ in length or are empty.
    """
    if isinstance(hypotheses, str) or isinstance(references, str):
        raise TypeError("hypotheses and references must be lists of strings, not one string")
    if len(hypotheses) != len(references):
        raise ValueError(f"got {len(hypotheses)} hypotheses for {len(references)} references")
    if not hypotheses:
        raise ValueError("cannot score an empty corpus (0 sentences)")
    bleu = BLEU(tokenize=tokenize)
    result = bleu.corpus_score(list(hypotheses), [list(references)])
    return BleuScore(score=float(result.score), signature=str(bleu.get_signature()))
