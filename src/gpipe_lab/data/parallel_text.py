"""Real translation data from local parallel text files, with a cached joint subword tokenizer.

Layout under ``root``: ``train.<src_lang>``, ``train.<tgt_lang>``, ``valid.<src_lang>``,
``valid.<tgt_lang>`` (one sentence per line, lines aligned). An optional test set is read
from two plain-text files in sacrebleu's format (``test_src``, ``test_ref``). References
for BLEU are the raw target lines.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpipe_lab.data.checks import check_positive_int, require_path
from gpipe_lab.data.subword import load_or_train_tokenizer
from gpipe_lab.data.token_batching import TranslationDataset
from gpipe_lab.data.translation_datamodule import TranslationDataModule
from gpipe_lab.data.vocabulary import strip_special


def read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file without their line ends."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n").rstrip("\r") for line in f]


class ParallelTextDataModule(TranslationDataModule):
    """Parallel text from ``root`` (see module docstring), tokenized with a joint BPE/WordPiece.

    The tokenizer is trained on both training files and cached in ``root`` (or
    ``tokenizer_dir``) as ``tokenizer-<kind>-<vocab>-<hash>.json``; a later run with the same
    training text reuses it (``tokenizer_trained`` tells which happened). Training pairs with
    more than ``max_tokens`` subwords on a side are dropped; validation and test pairs are kept.

    Raises:
        FileNotFoundError: if a training/validation file or a given test file is missing.
        ValueError: if the two sides of a split differ in line count, only one of
            ``test_src``/``test_ref`` is given, or a size is out of range.
    """

    def __init__(
        self,
        root: str | Path,
        src_lang: str = "src",
        tgt_lang: str = "tgt",
        tokenizer: str = "bpe",
        vocab_size: int = 8000,
        max_tokens: int = 256,
        test_src: str | Path | None = None,
        test_ref: str | Path | None = None,
        tokenizer_dir: str | Path | None = None,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        self.root = Path(root).expanduser()
        self.max_tokens = check_positive_int("max_tokens", max_tokens)
        hint = f"Set data.root to a folder holding train.{src_lang}/train.{tgt_lang}/valid.{src_lang}/valid.{tgt_lang}."
        self.files = {
            (split, side): require_path(self.root / f"{split}.{lang}", f"{split} {side} text", hint)
            for split in ("train", "valid")
            for side, lang in (("src", src_lang), ("tgt", tgt_lang))
        }
        if (test_src is None) != (test_ref is None):
            raise ValueError("give both test_src and test_ref (sacrebleu-format plain text files) or neither")
        if test_src is not None and test_ref is not None:  # (both or neither, checked above)
            test_hint = "Set data.test_src and data.test_ref to existing plain-text files."
            self.files[("test", "src")] = require_path(test_src, "test source", test_hint)
            self.files[("test", "tgt")] = require_path(test_ref, "test reference", test_hint)
        train_files = [self.files[("train", "src")], self.files[("train", "tgt")]]
        folder = Path(tokenizer_dir).expanduser() if tokenizer_dir is not None else self.root
        folder.mkdir(parents=True, exist_ok=True)
        self.tokenizer, self.tokenizer_path, self.tokenizer_trained = load_or_train_tokenizer(
            train_files, folder, tokenizer, vocab_size
        )
        self.vocab_size = self.tokenizer.get_vocab_size()

    def _split(self, split: str, filter_long: bool) -> tuple[TranslationDataset, list[str]]:
        src, tgt = read_lines(self.files[(split, "src")]), read_lines(self.files[(split, "tgt")])
        if len(src) != len(tgt):
            raise ValueError(
                f"{self.files[(split, 'src')]} has {len(src)} lines but {self.files[(split, 'tgt')]} has {len(tgt)}"
            )
        src_ids = [e.ids for e in self.tokenizer.encode_batch(src, add_special_tokens=False)]
        tgt_ids = [e.ids for e in self.tokenizer.encode_batch(tgt, add_special_tokens=False)]
        keep = [
            i for i in range(len(src))
            if not filter_long or (0 < len(src_ids[i]) <= self.max_tokens and 0 < len(tgt_ids[i]) <= self.max_tokens)
        ]
        return TranslationDataset([(src_ids[i], tgt_ids[i]) for i in keep]), [tgt[i] for i in keep]

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, _ = self._split("train", filter_long=True)
            self.val_set, self.val_references = self._split("valid", filter_long=False)
        if ("test", "src") in self.files and self.test_set is None:
            self.test_set, self.test_references = self._split("test", filter_long=False)

    def encode(self, text: str) -> list[int]:
        """Subword ids of ``text`` (no BOS/EOS)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Detokenized text of ``ids`` (stops at EOS, skips PAD/BOS)."""
        return self.tokenizer.decode(strip_special(ids), skip_special_tokens=False)
