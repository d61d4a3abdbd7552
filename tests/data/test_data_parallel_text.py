"""Parallel text files: tokenizer trained, cached and reused; batches; test set; missing files."""

import random

import pytest

from gpipe_lab.data import ParallelTextDataModule, SyntheticLanguagePair, build_datamodule


def _write_corpus(root, n_train=300, n_valid=30):
    lang = SyntheticLanguagePair(0)
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_valid)):
        pairs = [lang.sample(rng) for _ in range(n)]
        # Real text has capitals and punctuation: keep them, decoding must give them back.
        (root / f"{split}.en").write_text("".join(" ".join(s).capitalize() + " .\n" for s, _ in pairs))
        (root / f"{split}.de").write_text("".join(" ".join(t).capitalize() + ", ja!\n" for _, t in pairs))
    return root


def test_tokenizer_is_trained_cached_and_reused(tmp_path):
    root = _write_corpus(tmp_path / "corpus")
    kw = dict(src_lang="en", tgt_lang="de", vocab_size=300, tokens_per_batch=256)
    first = ParallelTextDataModule(root, **kw)
    assert first.tokenizer_trained and first.tokenizer_path.exists() and first.tokenizer_path.parent == root
    assert [first.tokenizer.id_to_token(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    second = build_datamodule("parallel_text", root=str(root), **kw)
    assert not second.tokenizer_trained and second.tokenizer_path == first.tokenizer_path
    assert second.vocab_size == first.vocab_size <= 300
    other = ParallelTextDataModule(root, **{**kw, "vocab_size": 200})
    assert other.tokenizer_trained and other.tokenizer_path != first.tokenizer_path


def test_batches_decode_and_references(tmp_path):
    root = _write_corpus(tmp_path)
    dm = ParallelTextDataModule(root, "en", "de", vocab_size=300, tokens_per_batch=200)
    dm.setup("fit")
    assert len(dm.train_set) == 300 and len(dm.val_references) == 30
    line = dm.val_references[0]
    assert dm.decode(dm.encode(line)) == line  # detokenization is exact with BPE + Metaspace
    for ((src, tgt_in), tgt_out), refs in zip(dm.val_dataloader(), dm.batch_references("val")):
        assert src.numel() <= 200 and tgt_in.shape == tgt_out.shape
        assert [dm.decode(row) for row in tgt_out] == refs


def test_test_set_from_plain_text_files(tmp_path):
    root = _write_corpus(tmp_path)
    dm = ParallelTextDataModule(
        root, "en", "de", vocab_size=300, test_src=root / "test.en", test_ref=root / "test.de", batch_size=8,
        tokens_per_batch=None,
    )
    dm.setup("test")
    assert len(dm.test_references) == 30
    assert sum(src.shape[0] for (src, _), _ in dm.test_dataloader()) == 30
    assert len(sum(dm.batch_indices("test"), [])) == 30


def test_wordpiece_tokenizer(tmp_path):
    root = _write_corpus(tmp_path)
    dm = ParallelTextDataModule(root, "en", "de", vocab_size=300, tokenizer="wordpiece")
    assert dm.tokenizer_path.name.startswith("tokenizer-wordpiece-300-")
    dm.setup("fit")
    text = dm.val_references[0]
    assert dm.decode(dm.encode(text)) == text  # the WordPiece decoder re-attaches "," and "!"


def test_missing_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train\.src.*data\.root"):
        ParallelTextDataModule(tmp_path / "missing")
    root = _write_corpus(tmp_path / "c")
    (root / "valid.de").unlink()
    with pytest.raises(FileNotFoundError, match=r"valid\.de"):
        ParallelTextDataModule(root, "en", "de")
    root = _write_corpus(tmp_path / "d")
    with pytest.raises(FileNotFoundError, match="nope.de"):
        ParallelTextDataModule(root, "en", "de", vocab_size=300, test_src=root / "test.en", test_ref=root / "nope.de")
    with pytest.raises(ValueError, match="test_ref"):
        ParallelTextDataModule(root, "en", "de", vocab_size=300, test_src=root / "test.en")
    with pytest.raises(ValueError, match="tokenizer"):
        ParallelTextDataModule(root, "en", "de", tokenizer="sentencepiece")
