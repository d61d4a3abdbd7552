"""A joint subword tokenizer (Hugging Face ``tokenizers``), trained once and cached next to the data.

The special tokens take ids 0–3 in the shared order ``<pad> <s> </s> <unk>``. BPE uses a
Metaspace pre-tokenizer and decoder, so decoding restores the original spacing exactly;
WordPiece splits on whitespace and punctuation and its decoder re-attaches punctuation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from gpipe_lab.data.checks import check_positive_int
from gpipe_lab.data.vocabulary import SPECIAL_TOKENS, UNK_ID

TOKENIZER_KINDS = ("bpe", "wordpiece")


def fingerprint(files: Sequence[Path]) -> str:
    """Short hash of the files' sizes and first MiB: it changes when the training text changes."""
    h = hashlib.sha1()
    for f in files:
        h.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:10]


def cache_path(folder: Path, kind: str, vocab_size: int, files: Sequence[Path]) -> Path:
    """Where the tokenizer trained on ``files`` is cached: ``folder/tokenizer-<kind>-<vocab>-<hash>.json``."""
    return folder / f"tokenizer-{kind}-{vocab_size}-{fingerprint(files)}.json"


def _new_tokenizer(kind: str, vocab_size: int) -> tuple[Tokenizer, trainers.Trainer]:
    unk = SPECIAL_TOKENS[UNK_ID]
    trainer: trainers.Trainer
    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=unk))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    else:
        tok = Tokenizer(models.WordPiece(unk_token=unk))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tok.normalizer = normalizers.NFKC()
    return tok, trainer


def load_or_train_tokenizer(
    files: Sequence[Path], folder: Path, kind: str = "bpe", vocab_size: int = 8000
) -> tuple[Tokenizer, Path, bool]:
    """Load the cached tokenizer for ``files`` from ``folder``, or train one on them and cache it.

    Returns:
        ``(tokenizer, cache file, trained)`` where ``trained`` is False when the cache was reused.

    Raises:
        ValueError: if ``kind`` is not one of ``TOKENIZER_KINDS`` or ``vocab_size`` is below 8.
        RuntimeError: if the trained tokenizer does not give the special tokens ids 0–3.
    """
    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer must be one of {TOKENIZER_KINDS}, got {kind!r}")
    check_positive_int("vocab_size", vocab_size, minimum=8)
    path = cache_path(folder, kind, vocab_size, files)
    if path.exists():
        return Tokenizer.from_file(str(path)), path, False
    tok, trainer = _new_tokenizer(kind, vocab_size)
    tok.train([str(f) for f in files], trainer)
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"special tokens got ids {ids}, expected [0, 1, 2, 3]")
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(path)  # atomic: concurrent ranks never read a half-written cache
    return tok, path, True
