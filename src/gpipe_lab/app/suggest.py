"""``did you mean``: the closest valid key or option for a command-line override Hydra would reject.

``gpipe-train`` asks before Hydra parses the command line, so the lab's hint is what the user
reads (Hydra's own message would come first and suggest ``+key=value``, which adds a key that
nothing reads). Options are matched against the everyday presets first (``EVERYDAY``), so
``model=transfomer`` suggests ``transformer_tiny``, not a Table-1 giant.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

#: The documented everyday options of a group, preferred in suggestions over the paper's presets.
EVERYDAY = {"model": ("amoebanet_d_tiny", "transformer_tiny"), "data": ("synthetic_images", "synthetic_translation"),
            "experiment": ("transformer_tiny", "amoebanet_d_tiny_k4", "transfer_synthetic"),
            "trainer": ("cpu", "smoke", "distributed"), "logger": ("wandb", "csv", "none")}


def option_hint(group: str, value: str, options: list[str]) -> str:
    """``group=value`` names no option: the closest everyday option, else the closest one, else all."""
    close = difflib.get_close_matches(value, [o for o in EVERYDAY.get(group, ()) if o in options], n=1)
    close = close or difflib.get_close_matches(value, options, n=1)
    if close:
        return f"{group}={value}: no such option; did you mean {group}={close[0]}? (options: {', '.join(options)})"
    return f"{group}={value}: no such option; options: {', '.join(options)}"


def _flat_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    for k in node:
        path = f"{prefix}{k}"
        keys.append(path)
        child = node._get_node(k)  # no interpolation resolved: ${hydra:...} fails outside a run
        if isinstance(child, DictConfig):
            keys.extend(_flat_keys(child, path + "."))
    return keys


def suggest_overrides(config_dir: str, overrides: list[str]) -> list[str]:
    """For command-line overrides that name no key or option of the config, ``did you mean``
    hints with the closest valid key (``pipeline.chunk`` -> ``pipeline.chunks``) or option
    (``model=transformer_tny`` -> ``model=transformer_tiny``), and the quoting rule for a value
    holding ``=`` (a Lightning checkpoint's name). Overrides with ``+``/``~``
    and Hydra's own are left alone. Returns no hint when the config cannot be composed at all.
    """
    root = Path(config_dir)
    groups = {p.name: sorted(q.stem for q in p.glob("*.yaml")) for p in root.iterdir() if p.is_dir()}
    hints: list[str] = []
    selections, keys = [], []
    for override in overrides:
        if override.startswith(("-", "+", "~")) or "=" not in override:
            continue
        key, value = override.split("=", 1)
        if key.startswith("hydra"):
            continue
        if "=" in value and not value.startswith(("'", '"')):  # Lightning's epoch=0-step=60.ckpt
            hints.append(f"{override}: a value holding '=' must be quoted for Hydra, quotes included in the "
                         f"shell: \"{key}='{value}'\"")
            continue
        if key in groups:
            options = groups[key]
            if "," not in value and value not in (*options, "null"):
                hints.append(option_hint(key, value, options))
                continue
            selections.append(override)
        else:
            keys.append(key)
    if not keys:
        return hints
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(root)):
            cfg = compose("train", overrides=selections)
    except Exception:  # noqa: BLE001 - hints are best effort; Hydra already reported the error
        return hints
    finally:
        GlobalHydra.instance().clear()
    known = _flat_keys(cfg)
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hints.append(f"{key}: not a key of the config; did you mean {close[0]}?" if close else
                         f"{key}: not a key of the config (add it with +{key}=... if it is meant to be new)")
    return hints
