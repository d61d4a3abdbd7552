"""A model zoo of users' architecture shapes, tiny enough for CI, each an ``nn.Sequential``.

Every entry is what a user brings to the pipeline: torchvision CNNs flattened to a
layer sequence (so a cut can land before any of their in-place activations), a ViT
(class-token and positional-embedding parameters, attention with dropout), an
LSTM/GRU tagger trained with ``ignore_index`` and label smoothing, a sparse
embedding, a trainable front end that runs outside the pipe, and one parameter
shared by two layers. ``build(name)`` gives the layers, the front end (or None),
the batch maker and the loss; the same module runs unpipelined as plain PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models import mobilenet_v3_small, squeezenet1_1
from torchvision.models.resnet import BasicBlock
from torchvision.models.vision_transformer import EncoderBlock

CLASSES = 3
IGNORE = -100  # the tagger's padding label
WIDTH = 8
TOKENS = 16


@dataclass
class Zoo:
    """One architecture: ``layers`` (the pipe's module), ``front`` (trainable, outside the pipe, or
    None), ``batch(n, gen)`` -> (x, y), ``loss_fn(out, y)`` of one micro-batch (a mean, or a sum
    when ``normalizer(y)`` divides the batch's total) and whether its layers hold BatchNorm."""

    layers: nn.Sequential
    front: nn.Module | None
    batch: Callable[[int, torch.Generator], tuple[Tensor, Tensor]]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    normalizer: Callable[[Tensor], Tensor] | None = None


def flatten(*modules: nn.Module) -> list[nn.Module]:
    """Every ``nn.Sequential`` (torchvision's ``Conv2dNormActivation`` included) opened into its
    layers, recursively: each in-place activation becomes a layer a stage can start with."""
    out: list[nn.Module] = []
    for m in modules:
        out += flatten(*m) if isinstance(m, nn.Sequential) else [m]
    return out


def is_inplace(layer: nn.Module) -> bool:
    """An activation or dropout that overwrites its input."""
    return bool(getattr(layer, "inplace", False))


def _images(size: int) -> Callable[[int, torch.Generator], tuple[Tensor, Tensor]]:
    """Images of ``size`` pixels a side: the CNNs' last BatchNorm sees 2x2 per sample, so a
    micro-batch of one sample trains in plain PyTorch too."""
    def batch(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        return torch.randn(n, 3, size, size, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen)
    return batch


def _vectors(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randn(n, 4, generator=gen), torch.randn(n, CLASSES, generator=gen)


def _tokens(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randint(0, TOKENS, (n,), generator=gen), torch.randn(n, CLASSES, generator=gen)


def _sentences(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    tags = torch.randint(0, CLASSES, (n, 6), generator=gen)
    tags[torch.rand(n, 6, generator=gen) < 0.3] = IGNORE  # padding
    return torch.randint(0, TOKENS, (n, 6), generator=gen), tags


def _cross_entropy(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y)


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(out, y)


def _tagger_loss(out: Tensor, y: Tensor) -> Tensor:
    """The micro-batch's SUM over its labelled tokens (the pipe divides by ``_labelled``)."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=IGNORE, label_smoothing=0.1,
                           reduction="sum")


def _labelled(y: Tensor) -> Tensor:
    return (y != IGNORE).sum()


def resnet() -> Zoo:
    """ResNet-18's layout (stem, 4 stages of 2 torchvision ``BasicBlock``s) at 1/8 of its widths."""
    widths, blocks, inplanes = (8, 16, 32, 64), [], 8
    for i, w in enumerate(widths):
        for b in range(2):
            stride = 2 if i and not b else 1
            down = None if stride == 1 and inplanes == w else nn.Sequential(
                nn.Conv2d(inplanes, w, 1, stride, bias=False), nn.BatchNorm2d(w))
            blocks.append(BasicBlock(inplanes, w, stride, down))
            inplanes = w
    layers = [nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
              nn.MaxPool2d(2), *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, CLASSES)]
    return Zoo(nn.Sequential(*layers), None, _images(32), _cross_entropy)


def mobilenet() -> Zoo:
    """torchvision's MobileNetV3-small at width 1/4 (Hardswish, squeeze-excitation, dropout)."""
    m = mobilenet_v3_small(weights=None, num_classes=CLASSES, width_mult=0.25)
    return Zoo(nn.Sequential(*flatten(m.features), m.avgpool, nn.Flatten(), *flatten(m.classifier)),
               None, _images(64), _cross_entropy)


def squeezenet() -> Zoo:
    """torchvision's SqueezeNet 1.1 (Fire modules, in-place ReLUs, dropout before a conv head)."""
    m = squeezenet1_1(weights=None, num_classes=CLASSES)
    return Zoo(nn.Sequential(*flatten(m.features, m.classifier), nn.Flatten()), None, _images(48),
               _cross_entropy)


class Patches(nn.Module):
    """4x4 patches of an image as tokens: (N, 3, 8, 8) -> (N, 4, WIDTH)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, WIDTH, 4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class ClassToken(nn.Module):
    """Prepends a learned token (a parameter concatenated in front of the patches)."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, WIDTH) * 0.02)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.token.expand(x.shape[0], -1, -1), x], dim=1)


class PositionEmbedding(nn.Module):
    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.embedding = nn.Parameter(torch.randn(1, tokens, WIDTH) * 0.02)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.embedding


class First(nn.Module):
    """The class token's features."""

    def forward(self, x: Tensor) -> Tensor:
        return x[:, 0]


def vit(dropout: bool = True) -> Zoo:
    """A ViT: patches, class token, positional embedding, two torchvision encoder blocks
    (``nn.MultiheadAttention`` with attention dropout, MLP dropout: p=0.1, or 0 without
    ``dropout``), the class token's head."""
    p = 0.1 if dropout else 0.0
    blocks = [EncoderBlock(num_heads=2, hidden_dim=WIDTH, mlp_dim=2 * WIDTH, dropout=p, attention_dropout=p)
              for _ in range(2)]
    layers = [Patches(), ClassToken(), PositionEmbedding(5), *blocks, nn.LayerNorm(WIDTH),
              First(), nn.Linear(WIDTH, CLASSES)]
    return Zoo(nn.Sequential(*layers), None, _images(8), _cross_entropy)


class Recurrent(nn.Module):
    """An ``nn.LSTM``/``nn.GRU`` layer's output sequence (its final state dropped)."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: Tensor) -> Tensor:
        return self.rnn(x)[0]


def tagger() -> Zoo:
    """A sequence tagger: embedding, LSTM, GRU, per-token classes; cross-entropy with padding
    (``ignore_index``) and label smoothing, normalized by the batch's labelled tokens."""
    layers = [nn.Embedding(TOKENS, WIDTH), Recurrent(nn.LSTM(WIDTH, WIDTH, batch_first=True)),
              Recurrent(nn.GRU(WIDTH, WIDTH, batch_first=True)), nn.Linear(WIDTH, CLASSES)]
    return Zoo(nn.Sequential(*layers), None, _sentences, _tagger_loss, _labelled)


def sparse() -> Zoo:
    """``nn.Embedding(sparse=True)`` first: its gradient is a sparse tensor."""
    layers = [nn.Embedding(TOKENS, WIDTH, sparse=True), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
              nn.Linear(WIDTH, CLASSES)]
    return Zoo(nn.Sequential(*layers), None, _tokens, _mse)


def front() -> Zoo:
    """A trainable front end outside the pipe: the pipe's input is part of the caller's graph."""
    layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, CLASSES)]
    return Zoo(nn.Sequential(*layers), nn.Sequential(nn.Linear(4, WIDTH), nn.Tanh()), _vectors, _mse)


def shared() -> Zoo:
    """Layers 2 and 4 use one weight (tied); a cut between them must be refused."""
    tied = nn.Linear(WIDTH, WIDTH)
    again = nn.Linear(WIDTH, WIDTH)
    again.weight = tied.weight
    layers = [nn.Linear(4, WIDTH), nn.Tanh(), tied, nn.Tanh(), again, nn.Tanh(), nn.Linear(WIDTH, CLASSES)]
    return Zoo(nn.Sequential(*layers), None, _vectors, _mse)


MODELS: dict[str, Callable[..., Zoo]] = {
    "resnet": resnet, "mobilenet": mobilenet, "squeezenet": squeezenet, "vit": vit, "tagger": tagger,
    "sparse": sparse, "front": front, "shared": shared,
}
WITH_BATCH_NORM = ("resnet", "mobilenet")
WITH_DROPOUT = ("mobilenet", "squeezenet", "vit")
OPTIONAL_DROPOUT = ("vit",)  # built with or without its dropout
TOKEN_INPUTS = ("tagger", "sparse")  # their inputs are indices, without a gradient


def build(name: str, seed: int, dropout: bool = True) -> Zoo:
    """The zoo's ``name`` with the weights ``seed`` gives (the same for every call); a model of
    ``OPTIONAL_DROPOUT`` with its dropout probabilities 0 unless ``dropout``.

    Raises:
        ValueError: ``name`` not in ``MODELS``.
    """
    if name not in MODELS:
        raise ValueError(f"zoo model {name!r}; allowed: {sorted(MODELS)}")
    torch.manual_seed(seed)
    return MODELS[name](dropout) if name in OPTIONAL_DROPOUT else MODELS[name]()


def tied_cuts(layers: nn.Sequential) -> set[int]:
    """Cut positions c (a stage ends before layer c) that would split a parameter between stages."""
    owners: dict[int, list[int]] = {}
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            owners.setdefault(id(p), []).append(i)
    return {c for found in owners.values() for c in range(min(found) + 1, max(found) + 1)}


def plain_step(zoo: Zoo, x: Tensor, y: Tensor) -> Tensor:
    """The whole batch through plain PyTorch (front end and layers), its loss back-propagated."""
    h = zoo.front(x) if zoo.front is not None else x
    out = zoo.layers(h)
    loss = zoo.loss_fn(out, y)
    loss = loss / zoo.normalizer(y) if zoo.normalizer is not None else loss
    loss.backward()
    return loss.detach()
