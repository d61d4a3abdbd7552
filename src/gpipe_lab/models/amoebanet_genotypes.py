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


# One cell per line: ``op@input`` for each of the 10 operations, then ``|`` and the concatenated states.
_TABLE = """
d normal    1x1@1 max_pool_3x3@1 none@1 1x7_7x1@0 1x1@0 1x7_7x1@0 max_pool_3x3@2 none@2 avg_pool_3x3@1 1x1@5 | 0 3 4 6
d reduction max_pool_2x2@0 max_pool_3x3@0 none@2 3x3@1 1x7_7x1@2 max_pool_3x3@2 none@3 max_pool_2x2@1 avg_pool_3x3@2 1x1@3 | 4 5 6
b normal    1x1@1 max_pool_3x3@1 none@1 separable_3x3_2@0 1x1@1 separable_3x3_2@0 1x1@2 none@2 avg_pool_3x3@1 1x1@5 | 0 3 4 6
b reduction max_pool_2x2@0 max_pool_3x3@0 none@2 3x3@1 dil_2_separable_5x5_2@2 max_pool_3x3@2 none@3 separable_3x3_2@1 avg_pool_3x3@4 1x1@3 | 5 6
"""


def _cell(text: str) -> CellSpec:
    pairs, concat = text.split("|")
    ops, indices = zip(*(token.split("@") for token in pairs.split()))
    return CellSpec(ops=tuple(ops), indices=tuple(int(i) for i in indices), concat=tuple(int(c) for c in concat.split()))


def _genotypes(table: str) -> dict[str, Genotype]:
    cells: dict[str, dict[str, CellSpec]] = {}
    for line in table.strip().splitlines():
        name, kind, rest = line.split(maxsplit=2)
        cells.setdefault(name, {})[kind] = _cell(rest)
    return {name: Genotype(**kinds) for name, kinds in cells.items()}


GENOTYPES = _genotypes(_TABLE)
AMOEBANET_D, AMOEBANET_B = GENOTYPES["d"], GENOTYPES["b"]
