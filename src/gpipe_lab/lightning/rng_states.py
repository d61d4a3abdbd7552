"""The global random states a resumable checkpoint carries (torch, CUDA, ``random``, numpy)."""

from __future__ import annotations

import random
from typing import Any

import torch

RNG_KEY = "gpipe_lab_rng_states"


def rng_states() -> dict[str, Any]:
    """The global RNG states (torch CPU and CUDA, ``random``, numpy when installed), as
    tensors and plain Python values (Lightning loads checkpoints with ``weights_only=True``)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state = np.random.get_state()
        assert isinstance(state, tuple)  # the legacy form (the default): MT19937's tuple
        name, keys, pos, has_gauss, gauss = state  # plain types: weights_only loads them
        states["numpy"] = [str(name), torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss)]
    except ImportError:  # pragma: no cover - numpy is a torch dependency in practice
        pass
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "python" in states:
        random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy as np

        name, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
