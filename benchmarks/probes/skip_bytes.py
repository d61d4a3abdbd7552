"""Probe: bytes handed between stages per step, with long skips and with features carried in tuples.

The U-Net of ``gpipe_lab.bench.unet`` (encoder blocks stash, decoder blocks pop) is trained one
step on the local transport, cut into K stages, twice: with skips (each feature goes from its
encoder's stage straight to its decoder's) and written the old way (``carried``: every feature
rides in the boundary tuple through each stage between). Every value a stage hands to another
(activations, gradients, skip tensors and their gradients) is counted at the endpoint's ``send``:

    python -m benchmarks.probes.skip_bytes [--levels 3] [--width 256] [--batch 64] [--chunks 4]

Prints, per K, the bytes handed over in one step both ways and their ratio, and what the
stages strictly between a skip's two ends handle. The losses of the two must agree (checked).
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from gpipe_lab.bench.unet import carried, unet
from gpipe_lab.pipeline import GPipe


def even_balance(layers: int, parts: int) -> list[int]:
    return [layers // parts + (1 if i < layers % parts else 0) for i in range(parts)]


def bytes_per_step(model: nn.Sequential, balance: list[int], x: torch.Tensor, y: torch.Tensor,
                   chunks: int) -> tuple[float, int, Counter[int]]:
    """(loss, bytes handed over in one train_step, bytes each stage sent)."""
    pipe = GPipe(model, balance=balance, chunks=chunks, retain_cpu_memory=False)
    sent: Counter[int] = Counter()
    send = pipe.channel.send

    def counting(key, values, was_tensor, sender):  # type: ignore[no-untyped-def]
        sent[sender.index] += sum(v.numel() * v.element_size() for v in values if v is not None)
        send(key, values, was_tensor, sender)

    pipe.channel.send = counting  # type: ignore[method-assign]
    loss = pipe.train_step(x, y, F.mse_loss).item()
    return loss, sum(sent.values()), sent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, default=3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.batch, 8, generator=g), torch.randn(args.batch, 8, generator=g)
    layers = 2 * args.levels + 3
    print(f"U-Net, {args.levels} levels, width {args.width}, batch {args.batch}, {args.chunks} micro-batches, "
          f"float32; bytes handed between stages in one train_step (forward and backward)")
    print(f"{'K':>3} {'balance':>16} {'with skips':>14} {'carried':>14} {'ratio':>7}   sent per stage (skips | carried)")
    for K in range(2, min(layers, 5) + 1):
        balance = even_balance(layers, K)
        loss_s, total_s, per_s = bytes_per_step(unet(args.levels, args.width), balance, x, y, args.chunks)
        loss_c, total_c, per_c = bytes_per_step(carried(unet(args.levels, args.width)), balance, x, y,
                                                args.chunks)
        if abs(loss_s - loss_c) > 1e-5 * max(1.0, abs(loss_c)):
            raise SystemExit(f"K={K}: the two models disagree: loss {loss_s} with skips, {loss_c} carried")
        stages = " ".join(f"{per_s[j]}|{per_c[j]}" for j in range(K))
        print(f"{K:>3} {str(balance):>16} {total_s:>14,} {total_c:>14,} {total_c / total_s:>6.2f}x   {stages}")


if __name__ == "__main__":
    main()
