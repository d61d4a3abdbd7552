"""``did you mean``: the closest valid key or option for a command-line override Hydra rejects."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig


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
    (``model=transformer_tny`` -> ``model=transformer_tiny``). Overrides with ``+``/``~``
    and Hydra's own are left alone. Returns no hint when the config cannot be composed at all.
    """
    import difflib
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

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
        if key in groups:
            options = groups[key]
            if "," not in value and value not in (*options, "null"):
                close = difflib.get_close_matches(value, options, n=1)
                hints.append(f"{key}={value}: no such option; did you mean {key}={close[0]}?" if close else
                             f"{key}={value}: no such option; options: {', '.join(options)}")
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
