"""A tiny Transformer learns the synthetic language pair: BLEU rises well above zero in seconds."""

import time

import pytest
import torch
import torch.nn as nn

from gpipe_lab.data import PAD_ID, SyntheticTranslationDataModule, corpus_bleu, padding_mask

D_MODEL, STEPS, BLEU_THRESHOLD = 64, 200, 40.0


class TinySeq2Seq(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, D_MODEL, padding_idx=PAD_ID)
        self.position = nn.Embedding(64, D_MODEL)
        self.transformer = nn.Transformer(D_MODEL, 4, 2, 2, 128, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D_MODEL, vocab_size)

    def _embed(self, ids):
        return self.embed(ids) * D_MODEL**0.5 + self.position(torch.arange(ids.shape[1]))

    def forward(self, src, tgt_in):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1], dtype=torch.bool)
        src_pad, tgt_pad = ~padding_mask(src), ~padding_mask(tgt_in)
        h = self.transformer(
            self._embed(src), self._embed(tgt_in), tgt_mask=causal, src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad,
        )
        return self.head(h)


@torch.no_grad()
def greedy_decode(model, src, bos_id):
    ys = torch.full((src.shape[0], 1), bos_id, dtype=torch.long)
    for _ in range(src.shape[1] + 2):  # a target has as many words as its source
        ys = torch.cat([ys, model(src, ys)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ys[:, 1:]


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_tiny_transformer_reaches_bleu_threshold(one_thread):
    """Measured (2 shared cores, seed 0): BLEU 62 after 200 steps of <= 512 padded tokens (~5 s);
    1024-token batches reach 67 in 1.7x the time, and d_model 32 only 43 (too close to the bar).
    Threshold: BLEU > 40 after 200 steps of <= 512 padded tokens."""
    torch.manual_seed(0)
    dm = SyntheticTranslationDataModule(tokens_per_batch=512, num_train=4000, num_val=200, seed=0)
    model = TinySeq2Seq(dm.vocab_size)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    start, step, epoch = time.perf_counter(), 0, 0
    while step < STEPS:
        loader = dm.train_dataloader()
        loader.batch_sampler.set_epoch(epoch)
        for (src, tgt_in), tgt_out in loader:
            logits = model(src, tgt_in)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD_ID)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == STEPS:
                break
        epoch += 1
    model.eval()
    hyps, refs = [], []
    for ((src, _), _), batch_refs in zip(dm.val_dataloader(), dm.batch_references()):
        hyps += [dm.decode(row) for row in greedy_decode(model, src, dm.bos_id)]
        refs += batch_refs
    bleu = corpus_bleu(hyps, refs)
    print(f"synthetic translation: BLEU {bleu.score:.1f} after {STEPS} steps, {time.perf_counter() - start:.1f} s")
    assert bleu.score > BLEU_THRESHOLD, bleu
