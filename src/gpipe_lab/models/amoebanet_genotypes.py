"""AmoebaNet cell genotypes (tensorflow/tpu ``models/official/amoeba_net/model_specs.py``).

A cell has 5 pairs of operations. Pair ``p`` reads hidden states
``indices[2p]`` and ``indices[2p+1]``, applies ``ops[2p]`` / ``ops[2p+1]`` and adds
the results as hidden state ``2 + p``. State 0 is the newer input (the previous
cell's output), state 1 the older one. The cell output concatenates the states
listed in ``concat`` (the ones no pair consumed), along channels.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CellSpec", "Genotype", "AMOEBANET_D", "AMOEBANET_B", "GENOTYPES"]


@dataclass(frozen=True)
class CellSpec:
    ops: tuple[str, ...]
    indices: tuple[int, ...]
    concat: tuple[int, ...]


@dataclass(frozen=True)
class Genotype:
    normal: CellSpec
    reduction: CellSpec


AMOEBANET_D = Genotype(
    normal=CellSpec(
        ops=("1x1", "max_pool_3x3", "none", "1x7_7x1", "1x1", "1x7_7x1", "max_pool_3x3", "none",
             "avg_pool_3x3", "1x1"),
        indices=(1, 1, 1, 0, 0, 0, 2, 2, 1, 5),
        concat=(0, 3, 4, 6),
    ),
    reduction=CellSpec(
        ops=("max_pool_2x2", "max_pool_3x3", "none", "3x3", "1x7_7x1", "max_pool_3x3", "none",
             "max_pool_2x2", "avg_pool_3x3", "1x1"),
        indices=(0, 0, 2, 1, 2, 2, 3, 1, 2, 3),
        concat=(4, 5, 6),
    ),
)

AMOEBANET_B = Genotype(
    normal=CellSpec(
        ops=("1x1", "max_pool_3x3", "none", "separable_3x3_2", "1x1", "separable_3x3_2", "1x1", "none",
             "avg_pool_3x3", "1x1"),
        indices=(1, 1, 1, 0, 1, 0, 2, 2, 1, 5),
        concat=(0, 3, 4, 6),
    ),
    reduction=CellSpec(
        ops=("max_pool_2x2", "max_pool_3x3", "none", "3x3", "dil_2_separable_5x5_2", "max_pool_3x3",
             "none", "separable_3x3_2", "avg_pool_3x3", "1x1"),
        indices=(0, 0, 2, 1, 2, 2, 3, 1, 4, 3),
        concat=(5, 6),
    ),
)

GENOTYPES = {"d": AMOEBANET_D, "b": AMOEBANET_B}
