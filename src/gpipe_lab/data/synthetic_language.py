"""A generated language pair: the target is a real transformation of the source.

Source (SVO, adjective before noun, determiner first)::

    [det] adj* noun  verb  [det] adj* noun  [prep [det] adj* noun]  [adverb]

Target (SOV, noun before adjectives, determiner last, postpositions)::

    noun adj* [det]  noun adj* [det]  [noun adj* [det] postp]  [adverb]  verb

Every source word maps to a target word of a different, generated vocabulary. Number
agreement: target nouns and adjectives take the number of their noun (singular/plural
forms are different words) and the target verb agrees with the *subject's* number, so
the model must look back across the sentence. Source nouns have singular/plural forms;
source adjectives and verbs do not. About 40 source and 52 target words; 3–12 source
words per sentence. Vocabulary and grammar come from ``language_seed``, sentences from
the generator passed to ``sample``.
"""

from __future__ import annotations

import random

from gpipe_lab.data.vocabulary import WordVocabulary

_SRC_PHONES = ("ptkbdgmnlrs", "aeiou")
_TGT_PHONES = ("zvfhjwcxq", "aeiouy")
_COUNTS = {"noun": 10, "adj": 6, "verb": 6, "det": 2, "prep": 2, "adv": 4}


def _words(rng: random.Random, phones: tuple[str, str], n: int, syllables: tuple[int, ...], taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        w = "".join(rng.choice(phones[0]) + rng.choice(phones[1]) for _ in range(rng.choice(syllables)))
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


class SyntheticLanguagePair:
    """Lexicons and grammar of the generated pair (see module docstring).

    Attributes:
        vocab: the joint ``WordVocabulary`` (special tokens, then source, then target words).
    """

    def __init__(self, language_seed: int = 0) -> None:
        rng = random.Random(language_seed)
        taken: set[str] = set()
        self.src: dict[str, list[str]] = {}
        self.tgt: dict[str, list[str]] = {}
        for cat, n in _COUNTS.items():
            syl = (1,) if cat in ("det", "prep") else (2, 3)
            self.src[cat] = _words(rng, _SRC_PHONES, n, syl, taken)
            self.tgt[cat] = _words(rng, _TGT_PHONES, n, syl, taken)
        self.src_plural = {w: w + "s" for w in self.src["noun"]}  # English-like plural on nouns only
        suffix = {"noun": "en", "adj": "e", "verb": "an"}  # target plural forms (agreement)
        self.tgt_plural = {cat: {w: w + suffix[cat] for w in self.tgt[cat]} for cat in suffix}
        src_words = [w for cat in _COUNTS for w in self.src[cat]] + list(self.src_plural.values())
        tgt_words = [w for cat in _COUNTS for w in self.tgt[cat]]
        tgt_words += [w for forms in self.tgt_plural.values() for w in forms.values()]
        self.vocab = WordVocabulary(src_words + tgt_words)
        self.num_source_words, self.num_target_words = len(src_words), len(tgt_words)

    def _noun_phrase(self, rng: random.Random) -> tuple[list[str], list[str], bool]:
        plural = rng.random() < 0.4
        noun = rng.randrange(_COUNTS["noun"])
        adjs = rng.sample(range(_COUNTS["adj"]), rng.choices((0, 1, 2), weights=(5, 4, 1))[0])
        det = rng.randrange(_COUNTS["det"]) if rng.random() < 0.5 else None
        src = ([self.src["det"][det]] if det is not None else []) + [self.src["adj"][a] for a in adjs]
        src.append(self.src_plural[self.src["noun"][noun]] if plural else self.src["noun"][noun])
        tgt = [self._form("noun", noun, plural)] + [self._form("adj", a, plural) for a in reversed(adjs)]
        tgt += [self.tgt["det"][det]] if det is not None else []
        return src, tgt, plural

    def _form(self, cat: str, index: int, plural: bool) -> str:
        word = self.tgt[cat][index]
        return self.tgt_plural[cat][word] if plural else word

    def sample(self, rng: random.Random, min_len: int = 3, max_len: int = 12) -> tuple[list[str], list[str]]:
        """One ``(source words, target words)`` pair with ``min_len <= len(source) <= max_len``.

        Raises:
            ValueError: if the range cannot be met (``min_len > max_len`` or ``max_len < 3``).
        """
        if min_len > max_len or max_len < 3:
            raise ValueError(f"need 3 <= max_len and min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        while True:
            s_src, s_tgt, s_plural = self._noun_phrase(rng)
            o_src, o_tgt, _ = self._noun_phrase(rng)
            verb = rng.randrange(_COUNTS["verb"])
            src = s_src + [self.src["verb"][verb]] + o_src
            tgt = s_tgt + o_tgt
            if rng.random() < 0.4:
                prep = rng.randrange(_COUNTS["prep"])
                p_src, p_tgt, _ = self._noun_phrase(rng)
                src += [self.src["prep"][prep]] + p_src
                tgt += p_tgt + [self.tgt["prep"][prep]]
            if rng.random() < 0.3:
                adv = rng.randrange(_COUNTS["adv"])
                src.append(self.src["adv"][adv])
                tgt.append(self.tgt["adv"][adv])
            tgt.append(self._form("verb", verb, s_plural))
            if min_len <= len(src) <= max_len:
                return src, tgt
