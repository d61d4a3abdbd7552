"""Training metrics computed on the last stage reach every rank of the pipeline.

In distributed runs only the last stage's rank has the outputs, so a module's
``log_train`` logs output-based metrics (``train/acc``, ...) only there, while the
loggers write on global rank 0 (the first stage). ``log_train_shared`` runs
``log_train`` on every rank, records what each ``self.log`` call logged
(``PipelineModule.recording_logs``), broadcasts
the last stage's records over the pipeline's process group, and replays on the other
ranks the keys they did not log themselves. One replica's last stage feeds its own
pipeline (with data parallelism, rank 0 shows replica 0's output metrics; the loss
is already the replicas' mean).
"""

from __future__ import annotations

import numbers
from typing import Any

import torch.distributed as dist
from torch import Tensor

Record = tuple[str, Any, tuple, dict]


def _portable(value: Any) -> Any:
    """A picklable copy of a logged value (tensors on CPU); ``None`` if not replayable."""
    if isinstance(value, Tensor):
        return value.detach().float().cpu()
    if isinstance(value, numbers.Number):
        return value
    return None


def _record_logs(module: Any, fn: Any, *args: Any) -> tuple[list[Record], BaseException | None]:
    """Run ``fn(*args)`` recording each ``module.log`` call (``PipelineModule.recording_logs``)."""
    with module.recording_logs() as calls:
        try:
            fn(*args)
            error = None
        except Exception as exc:  # noqa: BLE001 - re-raised after the collective (no rank left hanging)
            error = exc
    return [(name, _portable(value), log_args, log_kwargs) for name, value, log_args, log_kwargs in calls], error


def log_train_shared(module: Any, pipe: Any, loss: Tensor, outputs: Any, targets: Any) -> None:
    """``module.log_train`` on every rank; the last stage's metrics are logged on all of them.

    A collective over ``pipe.pp_group``: every rank of the pipeline calls it.

    Raises:
        Exception: what ``log_train`` raised on this rank; RuntimeError naming the last
            stage's rank when it failed there.
    """
    records, error = _record_logs(module, module.log_train, loss, outputs, targets)
    last_rank = pipe.topo.last_rank
    is_last = pipe.is_last_stage
    payload: Any = None
    if is_last:
        payload = ("error", f"{type(error).__name__}: {error}") if error is not None else ("ok", records)
    box = [payload]
    device = pipe.device if pipe.device.type == "cuda" else None
    dist.broadcast_object_list(box, src=last_rank, group=pipe.pp_group, device=device)
    if error is not None:
        raise error
    status, shared = box[0]
    if status == "error":
        raise RuntimeError(f"log_train failed on rank {last_rank} (the last stage): {shared}")
    if is_last:
        return
    mine = {name for name, *_ in records}
    for name, value, log_args, log_kwargs in shared:
        if name in mine or value is None:
            continue
        if isinstance(value, Tensor):
            value = value.to(loss.device)
        module.log(name, value, *log_args, **log_kwargs)

