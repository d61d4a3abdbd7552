"""What the benchmarks and the paper experiments share: their workloads and their timer.

``benchmarks/`` and ``experiments/`` are script packages run from the repository
root (``python -m benchmarks.run``); the definitions both need live here, once.
"""

from gpipe_lab.bench.emulated import EmulatedLayer, EmulatedSpec, emulated_module, emulated_workload
from gpipe_lab.bench.timing import Timing, time_call, time_rounds
from gpipe_lab.bench.workloads import Workload, WorkloadSpec, mlp, mlp_module, tiny_linear

__all__ = ["EmulatedLayer", "EmulatedSpec", "Timing", "emulated_module", "emulated_workload", "Workload", "WorkloadSpec", "mlp", "mlp_module", "time_call", "time_rounds", "tiny_linear"]
