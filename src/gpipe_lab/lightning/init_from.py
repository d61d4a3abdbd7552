"""``init_from``: start a new run from a checkpoint's weights (transfer learning).

Every weight is loaded but the classifier's (the last layer of ``module.layers``), which stays
freshly initialized: always with ``fresh_classifier=True`` (the default of ``gpipe-train``'s
``fresh_classifier`` key, as in the paper's fine-tuning), and otherwise only when its shape
differs (another number of classes).
"""

from __future__ import annotations

from pathlib import Path

import torch


def load_initial_weights(module: torch.nn.Module, path: str | Path, fresh_classifier: bool = False) -> list[str]:
    """Load every weight of ``path`` (a Lightning checkpoint or a state dict, of the whole
    module or of its ``layers``) into ``module``, except the last layer's when ``fresh_classifier``
    or when their shapes differ.

    Returns the keys left as initialized (the new classifier's).

    Raises:
        FileNotFoundError: no file at ``path``.
        RuntimeError: a weight outside the last layer is missing or has another shape; the
            message gives each one's shape in the model and in the checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"init_from: checkpoint file not found: {path}")
    state = torch.load(path, map_location="cpu", weights_only=False)
    state = state.get("state_dict", state)
    own = module.state_dict()
    prefix = "layers." if any(k.startswith("layers.") for k in own) else ""
    if prefix and not any(k.startswith(prefix) for k in state):
        state = {prefix + k: v for k, v in state.items()}
    layers = getattr(module, "layers", None)
    last = None
    if isinstance(layers, torch.nn.Sequential) and len(layers):
        last = f"{prefix}{[n for n, _ in layers.named_children()][-1]}."
    keep = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape
            and not (fresh_classifier and last is not None and k.startswith(last))}
    skipped = sorted(k for k in own if k not in keep)
    bad = [k for k in skipped if last is None or not k.startswith(last)]
    if bad:
        detail = "; ".join(f"{k}: model {tuple(own[k].shape)} vs checkpoint "
                           f"{tuple(state[k].shape) if k in state else 'missing'}" for k in bad[:4])
        raise RuntimeError(f"init_from {path}: the checkpoint does not match the model outside its last layer "
                           f"({len(bad)} weights): {detail}")
    module.load_state_dict(keep, strict=False)
    return skipped
