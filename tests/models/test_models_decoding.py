"""Greedy and beam decoding: a tiny Transformer trained on a copy task reproduces its input."""

import pytest
import torch

from gpipe_lab.models import BOS, EOS, PAD, beam_search, build, greedy_decode, token_cross_entropy

VOCAB, LENGTH = 16, 6


def copy_batch(generator, size=64):
    src = torch.randint(4, VOCAB, (size, LENGTH), generator=generator)
    bos = torch.full((size, 1), BOS)
    eos = torch.full((size, 1), EOS)
    return src, torch.cat([bos, src], 1), torch.cat([src, eos], 1)


@pytest.fixture(scope="module")
def copy_model():
    # One intra-op thread: tiny kernels gain nothing from more, and a loaded 2-core machine
    # makes spinning OpenMP threads very slow.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build("transformer_tiny", vocab_size=VOCAB)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        src, tgt_in, tgt_out = copy_batch(g)
        loss = token_cross_entropy(model((src, tgt_in)), tgt_out)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    yield model
    torch.set_num_threads(threads)


def test_greedy_decoding_copies_input(copy_model):
    src, _, expected = copy_batch(torch.Generator().manual_seed(123), size=16)
    out = greedy_decode(lambda s, t: copy_model((s, t)), src, max_len=LENGTH + 3)
    assert out.shape == (16, LENGTH + 1)  # stops once every row emitted EOS
    assert torch.equal(out, expected)


def test_beam_search_copies_input_and_beam1_is_greedy(copy_model):
    src, _, expected = copy_batch(torch.Generator().manual_seed(7), size=8)
    forward = lambda s, t: copy_model((s, t))  # noqa: E731
    assert torch.equal(beam_search(forward, src, max_len=LENGTH + 3, beam_size=3), expected)
    assert torch.equal(beam_search(forward, src, max_len=LENGTH + 3, beam_size=1),
                       greedy_decode(forward, src, max_len=LENGTH + 3))


def test_pads_after_eos():
    # A fake model that says EOS first for row 0 and token 5 otherwise.
    def forward(src, tgt_in):
        logits = torch.zeros(src.shape[0], tgt_in.shape[1], VOCAB)
        logits[:, :, 5] = 1.0
        logits[0, :, EOS] = 2.0
        return logits

    out = greedy_decode(forward, torch.ones(2, 3, dtype=torch.long), max_len=4)
    assert out[0].tolist() == [EOS, PAD, PAD, PAD] and out[1].tolist() == [5, 5, 5, 5]
    with pytest.raises(ValueError, match="max_len"):
        greedy_decode(forward, torch.ones(2, 3, dtype=torch.long), max_len=0)


def test_decoding_through_a_pipeline_matches_the_module(copy_model):
    pipeline = pytest.importorskip("gpipe_lab.pipeline")
    pipe = pipeline.GPipe(copy_model, partitions=2, chunks=2)
    src, _, expected = copy_batch(torch.Generator().manual_seed(5), size=4)
    assert torch.equal(greedy_decode(lambda s, t: pipe((s, t)), src, max_len=LENGTH + 3), expected)
    assert torch.equal(beam_search(lambda s, t: pipe((s, t)), src, max_len=LENGTH + 3, beam_size=2), expected)
