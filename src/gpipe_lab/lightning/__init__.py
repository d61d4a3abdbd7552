"""Lightning integration: ``GPipeStrategy``, the pipelined LightningModules, callbacks."""

from gpipe_lab.lightning.pipeline_module import PipelineModule
from gpipe_lab.lightning.strategy import GPipeStrategy

__all__ = ["GPipeStrategy", "PipelineModule"]
