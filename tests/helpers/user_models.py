"""Small models of the shapes users bring (issue 45), shared by the engine's and the distributed
transport's tests: a ViT front, attention drawing dropout, an in-place first layer, a sparse embedding.
The ViT's class token and positional embedding are the zoo's (``helpers.zoo``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helpers.zoo import ClassToken, PositionEmbedding


class Patches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


class ClassHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x[:, 0])


def vit() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Patches(), ClassToken(), PositionEmbedding(5), nn.Linear(8, 8), nn.Tanh(), ClassHead())


class Attention(nn.Module):
    """Multi-head self-attention drawing its dropout inside the fused kernel (in training only)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, 2, 4).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             dropout_p=0.3 if self.training else 0.0)
        return out.transpose(1, 2).reshape(n, t, 8)


class TorchAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


def attention_model(kind: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), kind(), nn.Linear(8, 8), kind(), nn.Linear(8, 2))


class ScaleInPlace(nn.Module):
    """An in-place write whose replay on written values would differ (unlike ReLU's)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2).add_(1)


def inplace_model(first: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), first, nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))


def sparse_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 4), nn.Tanh(),
                         nn.Linear(4, 2))
