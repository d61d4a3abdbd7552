"""Synthetic language pair, token format, token-budget batching, sharding, references, BLEU."""

import random

import pytest
import torch

from gpipe_lab.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SyntheticLanguagePair,
    SyntheticTranslationDataModule,
    TokenBucketBatchSampler,
    build_datamodule,
    collate_translation,
    corpus_bleu,
    padding_mask,
)


def _dm(**kw):
    return SyntheticTranslationDataModule(**{"num_train": 400, "num_val": 60, **kw})


def test_same_seed_same_pairs_different_seed_differs():
    assert _dm(seed=1).train_pairs == _dm(seed=1).train_pairs
    assert _dm(seed=1).train_pairs != _dm(seed=2).train_pairs
    assert _dm(language_seed=5).vocab.tokens != _dm().vocab.tokens


def test_language_is_a_real_transformation():
    lang = SyntheticLanguagePair(0)
    assert 30 <= lang.num_source_words <= 60 and 30 <= lang.num_target_words <= 60
    src_words = set(lang.vocab.tokens[4 : 4 + lang.num_source_words])
    rng = random.Random(0)
    lengths = []
    for _ in range(300):
        src, tgt = lang.sample(rng)
        lengths.append(len(src))
        assert not set(tgt) & src_words  # a different vocabulary
        verb = next(i for i, w in enumerate(src) if w in lang.src["verb"])
        v = lang.src["verb"].index(src[verb])
        subject_plural = src[verb - 1] in lang.src_plural.values()
        expected = lang.tgt_plural["verb"][lang.tgt["verb"][v]] if subject_plural else lang.tgt["verb"][v]
        assert tgt[-1] == expected  # SVO -> SOV, verb agrees with the subject
        assert tgt[0] in lang.tgt["noun"] or tgt[0] in lang.tgt_plural["noun"].values()  # noun first
    assert min(lengths) == 3 and max(lengths) == 12


def test_batch_format_and_padding_mask():
    (src, tgt_in), tgt_out = collate_translation(
        [(torch.tensor([5, 6, 7]), torch.tensor([8, 9])), (torch.tensor([5]), torch.tensor([8, 9, 10]))]
    )
    assert src.tolist() == [[5, 6, 7, EOS_ID], [5, EOS_ID, PAD_ID, PAD_ID]]
    assert tgt_in.tolist() == [[BOS_ID, 8, 9, PAD_ID], [BOS_ID, 8, 9, 10]]
    assert tgt_out.tolist() == [[8, 9, EOS_ID, PAD_ID], [8, 9, 10, EOS_ID]]
    assert padding_mask(src).tolist() == [[True] * 4, [True, True, False, False]]


def test_token_budget_is_respected():
    dm = _dm(tokens_per_batch=64, num_train=1000)
    n = 0
    for (src, tgt_in), tgt_out in dm.train_dataloader():
        assert src.dtype == tgt_in.dtype == torch.long and tgt_in.shape == tgt_out.shape
        assert src.numel() <= 64 and tgt_in.numel() <= 64 and src.shape[0] == tgt_in.shape[0]
        n += src.shape[0]
    assert n == 1000
    sizes = [3, 50, 4, 4]  # one pair alone exceeds the budget: it gets a batch of its own
    batches = list(TokenBucketBatchSampler(sizes, tokens_per_batch=10, shuffle=False))
    assert sorted(map(sorted, batches)) == [[0, 2], [1], [3]]


def test_sentence_count_batches_and_bucketing():
    dm = _dm(tokens_per_batch=None, batch_size=16)
    batches = list(dm.batch_sampler(dm.train_set, train=True))
    assert all(len(b) <= 16 for b in batches) and sum(map(len, batches)) == 400
    spread = [max(dm.train_set.sizes[i] for i in b) - min(dm.train_set.sizes[i] for i in b) for b in batches]
    assert max(spread) <= 2  # buckets of similar length


def test_epochs_reshuffle_deterministically():
    a = TokenBucketBatchSampler(list(range(3, 13)) * 20, tokens_per_batch=60, seed=0)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    b = TokenBucketBatchSampler(list(range(3, 13)) * 20, tokens_per_batch=60, seed=0)
    b.set_epoch(1)
    assert list(b) == list(a)


def test_replicas_get_disjoint_equal_shards():
    shards = [_dm(tokens_per_batch=100, data_parallel_rank=r, data_parallel_size=3) for r in range(3)]
    train = [list(dm.batch_sampler(dm.train_set, train=True)) for dm in shards]
    assert len({len(t) for t in train}) == 1  # lockstep: same number of steps on every replica
    val = [sum(dm.batch_indices("val"), []) for dm in shards]
    assert sorted(sum(val, [])) == list(range(60))  # validation: every pair exactly once


def test_references_align_with_validation_batches():
    dm = build_datamodule("synthetic_translation", tokens_per_batch=128, num_train=50, num_val=40)
    assert dm.pad_id == 0 and dm.vocab_size == len(dm.vocab)
    for (_, tgt_out), refs in zip(dm.val_dataloader(), dm.batch_references()):
        assert [dm.decode(row) for row in tgt_out] == refs
    assert dm.decode([BOS_ID, dm.vocab.index[dm.val_pairs[0][1][0]], EOS_ID, 7]) == dm.val_pairs[0][1][0]
    train_sources = {tuple(s) for s, _ in dm.train_pairs}
    assert not any(tuple(s) in train_sources for s, _ in dm.val_pairs)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"tokens_per_batch": 0}, "tokens_per_batch"),
        ({"tokens_per_batch": None, "batch_size": 0}, "batch_size"),
        ({"tokens_per_batch": None}, "tokens_per_batch"),
        ({"num_train": 0}, "num_train"),
        ({"min_len": 1}, "min_len"),
        ({"data_parallel_rank": 1, "data_parallel_size": 1}, "data_parallel_rank"),
    ],
)
def test_bad_values_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        build_datamodule("synthetic_translation", **kwargs)


def test_bleu_perfect_empty_and_misuse():
    refs = ["the cat sat on the mat .", "a dog barks loudly today"]
    perfect = corpus_bleu(refs, refs)
    assert perfect.score == pytest.approx(100.0) and "nrefs:1" in perfect.signature
    assert corpus_bleu(["", ""], refs).score == 0.0
    assert 0 < corpus_bleu(["the cat sat on a mat .", "a dog barks today"], refs).score < 100
    with pytest.raises(ValueError, match="hypotheses"):
        corpus_bleu(["x"], refs)
    with pytest.raises(TypeError):
        corpus_bleu("the cat", "the cat")
