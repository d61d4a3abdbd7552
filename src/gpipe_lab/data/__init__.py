"""Datasets and LightningDataModules: synthetic defaults that need no files, and real local data.

Images: batches ``(x [B, 3, H, W] float32, y [B] long)``; attribute ``num_classes``.
Translation: batches ``((src [B, S], tgt_in [B, T]), tgt_out [B, T])`` of long ids in one
joint vocabulary with ``PAD=0, BOS=1, EOS=2, UNK=3``; attributes ``vocab_size``, ``pad_id``,
``decode(ids)``, ``val_references`` and ``batch_references()``. ``corpus_bleu`` scores
detokenized text with sacrebleu.
"""

from gpipe_lab.data.bleu import BleuScore, corpus_bleu
from gpipe_lab.data.datamodule_registry import DATAMODULES, build_datamodule
from gpipe_lab.data.image_datamodule import ImageDataModule, SyntheticImageDataModule
from gpipe_lab.data.image_transforms import Cutout, cifar_transform, imagenet_transform
from gpipe_lab.data.parallel_text import ParallelTextDataModule
from gpipe_lab.data.real_images import CIFARDataModule, ImageNetDataModule
from gpipe_lab.data.synthetic_images import SyntheticImageDataset
from gpipe_lab.data.synthetic_language import SyntheticLanguagePair
from gpipe_lab.data.token_batching import TokenBucketBatchSampler, TranslationDataset, collate_translation
from gpipe_lab.data.translation_datamodule import SyntheticTranslationDataModule, TranslationDataModule
from gpipe_lab.data.vocabulary import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    WordVocabulary,
    padding_mask,
)

__all__ = [
    "BOS_ID", "DATAMODULES", "EOS_ID", "PAD_ID", "SPECIAL_TOKENS", "UNK_ID",
    "BleuScore", "CIFARDataModule", "Cutout", "ImageDataModule", "ImageNetDataModule",
    "ParallelTextDataModule", "SyntheticImageDataModule", "SyntheticImageDataset",
    "SyntheticLanguagePair", "SyntheticTranslationDataModule", "TokenBucketBatchSampler",
    "TranslationDataModule", "TranslationDataset", "WordVocabulary", "build_datamodule",
    "cifar_transform", "collate_translation", "corpus_bleu", "imagenet_transform", "padding_mask",
]
