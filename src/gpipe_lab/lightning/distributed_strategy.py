"""``DistributedGPipeStrategy``: one process per stage and data-parallel replica (``DistributedGPipe``).

Built on Lightning's ``DDPStrategy``, which launches the processes (``Trainer(devices=K*D)``;
on CPU ``accelerator="cpu"``; or torchrun), sets the ranks, opens the process group and
provides reduce, barrier and broadcast. The model is never wrapped in
``DistributedDataParallel``: the engine owns the stage, the point-to-point traffic and the
data-parallel gradient average. This class adds what differs from DDP: the sampler shards by
replica (every stage of one pipeline reads the same batch), gradients are clipped by the
norm over every stage, the ``GradScaler`` agrees across ranks, training metrics computed on
the last stage reach every rank, and checkpoints hold every stage's weights and optimizer state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn

from gpipe_lab.lightning.engine import PipelineEngine, build_distributed_engine
from gpipe_lab.lightning.metric_sharing import log_train_shared
from gpipe_lab.lightning.pipeline_module import PipelineModule
from gpipe_lab.lightning.placement import place_outside
from gpipe_lab.lightning.scaling import agreeing_precision
from gpipe_lab.lightning.strategy import GPipeStrategy
from gpipe_lab.pipeline.devices.cpu_share import default_threads, warn_if_oversubscribed
from gpipe_lab.pipeline.distributed.resolve import nccl_failure_settings
from gpipe_lab.pipeline.distributed.topology import check_world
from gpipe_lab.pipeline.options import PipelineOptions
from gpipe_lab.pipeline.step.clipping import clip_grad_norm_

if TYPE_CHECKING:
    from gpipe_lab.pipeline.distributed import DistributedGPipe


class DistributedGPipeStrategy(GPipeStrategy, DDPStrategy, transport="distributed"):
    """``GPipeStrategy`` with ``transport="distributed"`` (see ``GPipeStrategy`` for the arguments)."""

    _cpu_threads: int | None = None  # set in setup_environment

    # The process group's devices and collectives are DDP's (GPipeStrategy's are those of a
    # process holding every stage, which come first in the method order).
    root_device = DDPStrategy.root_device
    reduce = DDPStrategy.reduce
    barrier = DDPStrategy.barrier
    broadcast = DDPStrategy.broadcast

    def transport_arguments(self, process_group_backend: str | None) -> dict[str, Any]:
        """The process group's backend and timeout (the pipeline's, at least a minute)."""
        return {"process_group_backend": process_group_backend,
                "timeout": nccl_failure_settings(max(60.0, float(self.options.timeout)))}

    def build_engine(self, layers: nn.Sequential, options: PipelineOptions) -> PipelineEngine:
        """This rank's stage of ``layers`` (a collective)."""
        return build_distributed_engine(layers, options, self.root_device, self.data_parallel_size,
                                        self._module().init_layer)

    @property
    def engine(self) -> DistributedGPipe:
        """The engine as its own type (built in ``setup``)."""
        assert self.pipe is not None, "the engine is built in setup()"
        return cast("DistributedGPipe", self.pipe)

    def prepare_precision(self) -> None:
        self.precision_plugin = agreeing_precision(self.precision_plugin)

    def module_stays_in_place(self) -> bool:
        return True  # the other stages' layers are on meta in this process

    # ------------------------------------------------------------------ ranks and data
    @property
    def data_parallel_size(self) -> int:
        return self.num_nodes * self.num_processes // self.num_stages

    @property
    def data_parallel_rank(self) -> int:
        if self.pipe is not None:
            return int(self.engine.dp_rank)
        return self.global_rank // self.num_stages

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard by data-parallel replica: every stage of one pipeline reads the same batch."""
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    def setup_environment(self) -> None:
        """Check the world size against K, give each CPU rank its threads, open the process group.

        Raises:
            ValueError: the world size is not a multiple of the number of stages.
        """
        world, k = self.num_nodes * self.num_processes, self.num_stages
        check_world(world, k, what=f"trainer.devices: world size {world} (devices x num_nodes)",
                    stages="pipeline.partitions", fix=f"set trainer.devices={k} (or a multiple of {k})")
        if self.root_device.type == "cpu":
            # Every rank, as each stage of the local transport, gets threads_per_stage (default:
            # the free cores / this node's processes): Lightning sets it on rank 0 only, and kernels
            # reduce in an order that depends on the thread count, so unequal ranks drift from the local run.
            threads = self.options.threads_per_stage or default_threads(self.num_processes)
            torch.set_num_threads(threads)
            self._cpu_threads = threads
            if self.local_rank == 0:
                warn_if_oversubscribed(self.num_processes, threads)
        super().setup_environment()

    @property
    def cpu_threads(self) -> int | None:
        return self._cpu_threads

    def model_to_device(self) -> None:
        """The engine placed this rank's layers (the others stay on meta); the rest goes to the root device."""
        assert self.model is not None
        if self.pipe is None:
            self.model.to(self.root_device)
            return
        place_outside(self.model, self._module().configure_layers(), self.root_device)

    # ------------------------------------------------------------------ what spans the ranks
    def log_train(self, module: PipelineModule, loss: Tensor, outputs: Any, targets: Any) -> None:
        if self.num_stages > 1:
            log_train_shared(module, self.pipe, loss, outputs, targets)
        else:
            module.log_train(loss, outputs, targets)

    def clip_grad_norm(self, optimizer: Any, max_norm: float) -> None:
        """Clip by the norm over ALL stages: foreach norms, their squares summed over the pipeline."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(params, float(max_norm), group=self.engine.pp_group, device=self.root_device)

    def step_report(self) -> tuple[Any, list[dict[str, int]]]:
        if self.pipe is None or self.pipe.timeline is None:
            return self.timeline, self.memory()
        return self.engine.gather_report(on_device=True)

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Every stage's weights under the original names (a collective)."""
        full = self.engine.full_state_dict() or {}
        prefix = self._module().layers_prefix()
        own = {k: v for k, v in self._module().state_dict().items() if not k.startswith(prefix)}
        return {**own, **{prefix + k: v for k, v in full.items()}}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        prefix = self._module().layers_prefix()
        state = checkpoint["state_dict"]
        self.engine.load_full_state_dict(
            {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer state of EVERY stage: parameters are indexed as in the unpipelined
        module (each rank holds the state of its own stage's indices), merged on every rank."""
        state = getattr(optimizer, "optimizer", optimizer).state_dict()  # a LightningOptimizer wraps it
        if self.num_stages == 1:
            return state
        local = {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                 for i, s in state["state"].items()}
        every: list[Any] = [None] * self.num_stages
        dist.all_gather_object(every, local, group=self.engine.pp_group)
        merged: dict[int, Any] = {}
        for part in every:
            merged.update(part)
        return {"state": dict(sorted(merged.items())), "param_groups": state["param_groups"]}

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            mine = {i: s for i, s in saved["state"].items() if not params[int(i)].is_meta}
            optimizer.load_state_dict({"state": mine, "param_groups": saved["param_groups"]})
