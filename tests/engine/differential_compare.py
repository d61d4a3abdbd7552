"""What differs between two observations of a case (``differential_run``'s runs)."""

from __future__ import annotations

import torch
from differential_cases import Case

Observed = dict[str, object]
SPLIT_BACKWARD = ("gpipe-bw", "zb-h1", "zb-h2", "zb-v", "dualpipev")


def differences(case: Case, got: Observed, want: Observed) -> list[str]:
    """Every observable that differs: 1e-5 in float32, 1e-10 in float64, and bf16's own
    precision where the engine rounds differently by design: the weight gradients of the
    split-backward schedules (one GEMM over the micro-batches in bf16)."""
    low = case.autocast == "bf16" and case.dtype == "float32"
    base = 1e-10 if case.dtype == "float64" else 1e-5
    out: list[str] = []

    def close(name: str, a: object, b: object) -> None:
        tol = base
        if low and name.startswith("grads") and case.schedule in SPLIT_BACKWARD:
            tol = 1e-2
        if a is None or b is None:
            if (a is None) != (b is None):
                out.append(f"{name}: engine {'None' if a is None else 'a tensor'}, "
                           f"plain {'None' if b is None else 'a tensor'}")
            return
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{name}: engine {a.dtype}{tuple(a.shape)}, plain {b.dtype}{tuple(b.shape)}")
        elif not torch.allclose(a.double(), b.double(), rtol=tol, atol=tol):
            out.append(f"{name}: max difference {(a.double() - b.double()).abs().max().item():.3g}")

    for key in ("loss", "norm"):
        if key in want:
            close(key, got.get(key), want[key])
    for i, (a, b) in enumerate(zip(got.get("outputs", []), want.get("outputs", []))):
        close(f"outputs[{i}]", a, b)
    if len(got.get("outputs", [])) != len(want.get("outputs", [])):
        out.append(f"outputs: engine gave {len(got.get('outputs', []))}, plain {len(want.get('outputs', []))}")
    for kind in ("grads", "buffers"):
        for name, b in want[kind].items():  # type: ignore[union-attr]
            close(f"{kind}[{name}]", got[kind].get(name), b)  # type: ignore[union-attr]
    for i, (a, b) in enumerate(zip(got["input_grad"], want["input_grad"])):  # type: ignore[arg-type]
        close(f"input_grad[{i}]", a, b)
    if got.get("sparse") != want.get("sparse"):
        out.append(f"sparse gradients: engine {got.get('sparse')}, plain {want.get('sparse')}")
    if got["probe"] != want["probe"]:
        out.append(f"(is_checkpointing, is_recomputing): engine {got['probe']}, torchgpipe's rule {want['probe']}")
    return out


def bitwise_differences(a: Observed, b: Observed) -> list[str]:
    """What differs, bit for bit, between two engine runs of the same case."""
    out = []
    flat_a, flat_b = _flatten(a), _flatten(b)
    for name in sorted(set(flat_a) | set(flat_b)):
        x, y = flat_a.get(name), flat_b.get(name)
        same = (x is None and y is None) if x is None or y is None else (
            torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y)
        if not same:
            out.append(f"{name} differs between two runs with the same seed")
    return out


def _flatten(obs: Observed) -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in obs.items():
        if isinstance(value, dict):
            flat.update({f"{key}[{k}]": v for k, v in value.items()})
        elif isinstance(value, list) and key != "probe":
            flat.update({f"{key}[{i}]": v for i, v in enumerate(value)})
        else:
            flat[key] = value
    return flat
