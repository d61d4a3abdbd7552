"""Lightning integration: ``GPipeStrategy``, the pipelined LightningModules, callbacks."""

from gpipe_lab.lightning.distributed_strategy import DistributedGPipeStrategy
from gpipe_lab.lightning.local_strategy import LocalGPipeStrategy
from gpipe_lab.lightning.pipeline_module import PipelineModule
from gpipe_lab.lightning.strategy import GPipeStrategy

__all__ = ["DistributedGPipeStrategy", "GPipeStrategy", "LocalGPipeStrategy", "PipelineModule"]
