"""One run folder for a torchrun launch: every rank writes into rank 0's.

Under torchrun each rank runs ``gpipe-train`` itself, and Hydra would make a run folder per rank
(``${now:...}`` differs by the second). Instead rank 0 tells the others the folder Hydra made for it,
through torchrun's key-value store (its agent's, at ``MASTER_ADDR:MASTER_PORT``), and every other
rank runs with ``hydra.run.dir=<that folder>``, logging to ``train_ddp_process_<rank>.log`` and
saving no ``.hydra`` copy: what Lightning's own launcher gives the processes it starts. Only rank 0
starts a wandb run (Lightning's loggers write on rank 0).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import Store

#: How long a rank waits for rank 0 to name its folder (rank 0 composes the same config first).
WAIT_S = 300.0


def under_torchrun() -> bool:
    """Whether this process is one rank of several started by torchrun (its agent hosts the store)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _store(timeout_s: float) -> Store:
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=timedelta(seconds=timeout_s))


def _key() -> str:
    # one key per launch and per restart of it
    return (f"gpipe_lab/run_dir/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")


def rank_overrides(args: Sequence[str]) -> list[str]:
    """The Hydra overrides a rank other than 0 adds to its command line: rank 0's run folder, its own
    log file, no ``.hydra`` copy. None on rank 0, outside torchrun, for a sweep, or when the command
    names ``hydra.run.dir`` itself (then every rank has the same folder already).

    Raises:
        SystemExit: rank 0 did not name its folder within ``WAIT_S`` seconds (one line).
    """
    if not under_torchrun() or _rank() == 0 or any(a.startswith("hydra.run.dir=") for a in args) \
            or {"-m", "--multirun"} & set(args):
        return []
    try:
        run_dir = _store(WAIT_S).get(_key()).decode()  # blocks until rank 0 sets it
    except RuntimeError as exc:  # the store's timeout, or rank 0's agent gone
        raise SystemExit(f"rank {_rank()}: rank 0 did not name its run folder within {WAIT_S:.0f} s "
                         f"({str(exc).splitlines()[0]})") from None
    return [f'hydra.run.dir="{run_dir}"', f"hydra.job.name=train_ddp_process_{_rank()}", "hydra.output_subdir=null"]


def publish_run_dir(run_dir: str) -> None:
    """On rank 0 of a torchrun launch: name ``run_dir`` to the other ranks (nothing elsewhere)."""
    if under_torchrun() and _rank() == 0:
        _store(WAIT_S).set(_key(), run_dir)
