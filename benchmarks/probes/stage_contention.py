"""Probe: why per-layer times alone under-predict a pipelined CPU step, and what the contended timing sees.

For the Table 2 AmoebaNet analogue (``conf/experiment/paper_table2_amoebanet.yaml``) at K=2,
M=32 (8-image micro-batches), prints stage 0's per-layer sums, as the simulator's
cost model takes them (``gpipe_lab.planner.layer_timing.layer_times``): alone and
beside a second thread running the same pass. Beside them, the median F, R and B
actions of a real K=2 step (``GPipe``, one thread per stage) and of a K=1 step
(the same layers with no neighbour). With ``--transformer`` the Table 2
Transformer analogue instead.

    python -m benchmarks.probes.stage_contention [--transformer] [M]
"""

from __future__ import annotations

import statistics
import sys

from gpipe_lab.app.config.experiments import compose_experiment, workload_of
from gpipe_lab.bench.step_timing import measure_step
from gpipe_lab.planner.layer_timing import layer_times


def main() -> None:
    """Print the table (milliseconds per action of stage 0)."""
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    name = "paper_table2_transformer" if "--transformer" in sys.argv else "paper_table2_amoebanet"
    work = workload_of(compose_experiment(name).experiment)  # Table 2's workload, as its config defines it
    chunks = int(args[0]) if args else 32
    micro = work.batch // chunks
    _, step2, balance = measure_step(work, 2, chunks, steps=3)
    _, step1, _ = measure_step(work, 1, chunks, steps=3)
    share = balance[0] / sum(balance)  # stage 0 of the K=2 split, against the whole model at K=1
    alone, beside = layer_times(work, micro), layer_times(work, micro, contended=True)
    print(f"{work.name}, {micro}-sample micro-batches, stage 0 = {balance[0]} of {sum(balance)} layers (ms)")
    print(f"{'action':<8}{'alone':>9}{'beside':>9}{'K=2 step':>10}{'K=1 step x share':>18}")
    for action, kind in (("F", "forward_nograd"), ("R", "recompute"), ("B", "backward")):
        solo, both = (1e3 * sum(t[kind][:balance[0]]) for t in (alone, beside))
        real = [1e3 * statistics.median(e.duration for e in tl.events if e.stage == 0 and e.kind == action)
                for tl in (step2, step1)]
        print(f"{action:<8}{solo:>9.1f}{both:>9.1f}{real[0]:>10.1f}{real[1] * share:>18.1f}")


if __name__ == "__main__":
    main()
