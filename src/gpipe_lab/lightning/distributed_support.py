"""The distributed half of ``GPipeStrategy``: processes, process groups, collectives.

One process per stage (and per data-parallel replica): Lightning launches them
(``Trainer(devices=K*D)``; on CPU ``accelerator="cpu"``) or torchrun does. The
engine's ``DistributedGPipe`` owns the stage and the point-to-point traffic;
this mixin owns what Lightning needs around it: ranks, the launcher, the
sampler arguments (one shard per data-parallel replica, NOT per stage),
reductions, and gradient clipping by the global norm across stages.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn

from gpipe_lab.lightning.scaling import engine_nonfinite
from gpipe_lab.pipeline.distributed.resolve import nccl_failure_settings


class DistributedMixin:
    """Helpers for ``GPipeStrategy(transport="distributed")``; inert for the local transport."""

    is_distributed: bool
    cluster_environment: Any
    parallel_devices: Any
    pipe: Any
    _process_group_backend: str | None
    _num_nodes: int

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        if not self.is_distributed:
            return 1
        return len(self.parallel_devices) if self.parallel_devices is not None else 1

    @property
    def data_parallel_size(self) -> int:
        if not self.is_distributed:
            return 1
        return self.num_nodes * self.num_processes // self.num_stages  # type: ignore[attr-defined]

    @property
    def data_parallel_rank(self) -> int:
        if self.pipe is not None and hasattr(self.pipe, "dp_rank"):
            return int(self.pipe.dp_rank)
        return 0 if not self.is_distributed else self.global_rank // self.num_stages  # type: ignore[attr-defined]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard by data-parallel replica: every stage of one pipeline reads the same batch."""
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    def _distributed_root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        return devices[self.local_rank % len(devices)]  # type: ignore[attr-defined]

    def _configure_launcher(self) -> None:
        if not self.is_distributed:
            return
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                       self.num_nodes)

    def set_world_ranks(self) -> None:
        if not self.is_distributed or self.cluster_environment is None:
            return
        self.cluster_environment.set_global_rank(
            self.node_rank * self.num_processes + self.local_rank)  # type: ignore[attr-defined]
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        if not self.is_distributed:
            return
        self.set_world_ranks()
        if self.root_device.type == "cpu":  # type: ignore[attr-defined]
            # Every rank, as each stage of the local transport, gets threads_per_stage (default:
            # cores / processes here): Lightning sets it on rank 0 only, and kernels reduce in an
            # order that depends on the thread count, so unequal ranks drift from the local run.
            threads = self.options.threads_per_stage or (os.cpu_count() or 1) // self.num_processes  # type: ignore[attr-defined]
            torch.set_num_threads(max(1, threads))
        world = self.num_nodes * self.num_processes
        if world % self.num_stages:  # type: ignore[attr-defined]
            k = self.num_stages  # type: ignore[attr-defined]
            raise ValueError(f"trainer.devices: world size {world} (devices x num_nodes) is not divisible by "
                             f"pipeline.partitions={k}: the distributed transport runs one process per stage "
                             f"and data-parallel replica; set trainer.devices={k} (or a multiple of {k})")
        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")  # type: ignore[attr-defined]
        self._process_group_backend = backend
        timeout = nccl_failure_settings(max(60.0, float(self.timeout)))  # type: ignore[attr-defined]
        _init_dist_connection(self.cluster_environment, backend, timeout=timeout)

    def _build_distributed_pipeline(self, layers: nn.Sequential) -> Any:
        """The engine's ``DistributedGPipe`` for this rank's stage (a collective)."""
        from gpipe_lab.lightning.engine import build_distributed_engine


        # under a GradScaler the scaler decides what an overflow does, not the engine's policy
        options = self.options.replace(  # type: ignore[attr-defined]
            nonfinite=engine_nonfinite(self.options.nonfinite, self.precision_plugin))  # type: ignore[attr-defined]
        return build_distributed_engine(layers, options, self.root_device,  # type: ignore[attr-defined]
                                        self.data_parallel_size,  # type: ignore[attr-defined]
                                        self._module().init_layer)  # type: ignore[attr-defined]

    def _distributed_reduce(self, tensor: Any, group: Any, reduce_op: Any) -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def _distributed_barrier(self) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    def _distributed_broadcast(self, obj: Any, src: int) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def _install_global_clipping(self) -> None:
        """Clip by the norm over ALL stages: the squared norms are all-reduced across ranks."""
        plugin = self.precision_plugin  # type: ignore[attr-defined]
        strategy = self

        def clip_grad_by_norm(optimizer: Any, clip_val: float | int) -> None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            device = strategy.root_device  # type: ignore[attr-defined]
            local = torch.zeros((), device=device, dtype=torch.float64)
            for g in grads:
                local += g.detach().double().pow(2).sum().to(device)
            group = strategy.pipe.pp_group
            dist.all_reduce(local, group=group)
            total = local.sqrt()
            coef = (float(clip_val) / (total + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(coef.to(g.device, g.dtype))

        plugin.clip_grad_by_norm = clip_grad_by_norm

    # ------------------------------------------------------------------ reports and checkpoints
    def _gather_memory(self) -> list[dict[str, int]]:
        every: list[Any] = [None] * self.num_stages  # type: ignore[attr-defined]
        dist.all_gather_object(every, self.pipe.memory(), group=self.pipe.pp_group)
        rows = [row for rank_rows in every for row in rank_rows]
        return sorted(rows, key=lambda r: r.get("stage", 0))

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Load weights after the pipeline exists (its stages own the real parameters)."""
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Every stage's weights under the original names (a collective in distributed)."""
        module = self.lightning_module  # type: ignore[attr-defined]
        if not self.is_distributed:
            return module.state_dict()
        full = self.pipe.full_state_dict() or {}
        prefix = self._layers_prefix()
        own = {k: v for k, v in module.state_dict().items() if not k.startswith(prefix)}
        return {**own, **{prefix + k: v for k, v in full.items()}}

    def _layers_prefix(self) -> str:
        module = self.lightning_module  # type: ignore[attr-defined]
        layers = module.configure_layers()
        for name, child in module.named_modules():
            if child is layers:
                return f"{name}." if name else ""
        return "layers."

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not self.is_distributed:
            super().load_model_state_dict(checkpoint, strict=strict)  # type: ignore[misc]
            return
        prefix = self._layers_prefix()
        state = checkpoint["state_dict"]
        self.pipe.load_full_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer state of EVERY stage: parameters are indexed as in the unpipelined
        module (each rank holds the state of its own stage's indices), merged on rank 0."""
        opt = getattr(optimizer, "_optimizer", optimizer)
        state = opt.state_dict()
        if not self.is_distributed or self.num_stages == 1:  # type: ignore[attr-defined]
            return state
        local = {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                 for i, s in state["state"].items()}
        every: list[Any] = [None] * self.num_stages  # type: ignore[attr-defined]
        dist.all_gather_object(every, local, group=self.pipe.pp_group)
        merged: dict[int, Any] = {}
        for part in every:
            merged.update(part)
        return {"state": dict(sorted(merged.items())), "param_groups": state["param_groups"]}

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if not self.is_distributed:
            super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]
            return
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"]):  # type: ignore[attr-defined]
            params = [p for group in optimizer.param_groups for p in group["params"]]
            mine = {i: s for i, s in saved["state"].items() if not params[int(i)].is_meta}
            optimizer.load_state_dict({"state": mine, "param_groups": saved["param_groups"]})
