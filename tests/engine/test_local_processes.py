"""``local_stages="processes"``: the local transport's ranks in stage processes of their own.

What the user sees must be what threads give, bit for bit (loss, outputs, every ``.grad``
and buffer, after several optimizer steps), and what plain PyTorch gives (the differential
harness's reference, 1e-5); a failing or dying stage process raises in the caller with the
stage's own error, and the processes end with the pipe. Every wait here is bounded by the
pipe's ``timeout`` (stage processes start within it, answer within it, stop within ``STOP_S``).
"""

from __future__ import annotations

import functools
import gc

import differential_run
import pytest
import torch
import torch.nn.functional as F
from differential_cases import Case
from differential_run import judge, run_engine
from torch import nn

from gpipe_lab.pipeline import GPipe, PipelineOptions
from gpipe_lab.pipeline.errors import PipelineTimeoutError
from gpipe_lab.pipeline.options import OptionError
from gpipe_lab.pipeline.processes.auto import ROUNDS, AutoTrial
from gpipe_lab.pipeline.processes.channel import StageProcessLost
from gpipe_lab.pipeline.processes.pool import STOP_S, ProcessExecutor
from helpers.faults import ExitOnce, Fault, HangOnce, InjectedFault

TIMEOUT = 60.0
CASES = [
    "door=train_step,K=2,M=4,batch=12,checkpoint=except_last,schedule=gpipe,bn=plain,rand=dropout",
    "door=train_step,K=2,M=3,batch=10,checkpoint=never,schedule=1f1b,bn=deferred,rand=dropout",
    "door=backward,K=2,M=4,batch=12,checkpoint=always,schedule=gpipe,bn=plain,rand=dropout",  # on threads
    "door=nograd_train,K=2,M=4,batch=12,checkpoint=except_last,schedule=1f1b,bn=deferred,rand=dropout",
]
REST = "autocast=none,inputs=tensor,frozen=False,dtype=float32,output=tensor,track_memory=True,transport=local"


def _processes(pipe: GPipe) -> list:
    assert isinstance(pipe.executor, ProcessExecutor)
    return list(pipe.executor.processes._procs.values())


@pytest.mark.parametrize("recipe", CASES)
def test_processes_match_plain_pytorch_and_threads_bit_for_bit(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case.parse(f"{recipe},{REST}")
    threads = run_engine(case)
    monkeypatch.setattr(differential_run, "GPipe", functools.partial(GPipe, local_stages="processes"))
    got = run_engine(case)
    gc.collect()  # the pipe's stage processes end with it
    # against plain PyTorch (1e-5), and threads' run bit for bit
    assert not judge(case, got, threads), recipe


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Dropout(0.25), nn.Linear(12, 12), nn.BatchNorm1d(12),
                         nn.Tanh(), nn.Linear(12, 12), nn.Dropout(0.1), nn.Linear(12, 3))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_optimizer_in_the_caller_trains_as_with_threads(schedule: str) -> None:
    """Three steps of SGD with momentum; between them gradients accumulate (no zero_grad), are
    zeroed in place, or set to None: ``.grad`` objects and values, losses, outputs, parameters
    and BatchNorm statistics equal threads' bit for bit."""
    torch.manual_seed(3)
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    seen = {}
    for mode in ("threads", "processes"):
        model = _model()
        pipe = GPipe(model, partitions=2, chunks=4, schedule=schedule, seed=7, local_stages=mode,
                     threads_per_stage=1, timeout=TIMEOUT)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses, outputs, same_objects = [], [], []
        for step in range(4):
            loss, out = pipe.train_step(x, y, F.mse_loss, return_outputs=True)
            losses.append(loss)
            outputs.append(out)
            before = [p.grad for p in model.parameters()]
            if step == 0:
                pipe.train_step(x, y, F.mse_loss)  # a second step accumulates before any update
            if step < 3:
                opt.step()
            if step == 1:
                opt.zero_grad(set_to_none=False)  # zeroed in place: the next step accumulates into them
            elif step == 2:
                opt.zero_grad(set_to_none=True)
            same_objects.append([p.grad is g for p, g in zip(model.parameters(), before)])
        pipe.eval()
        with torch.no_grad():
            evaluated = pipe(x)
        seen[mode] = (losses, outputs, [p.grad for p in model.parameters()], model.state_dict(), same_objects,
                      evaluated)
        pipe.close()
    (la, oa, ga, sa, ida, ea), (lb, ob, gb, sb, idb, eb) = seen["threads"], seen["processes"]
    assert all(torch.equal(a, b) for a, b in zip(la, lb))
    assert all(torch.equal(a, b) for a, b in zip(oa, ob))
    assert all(torch.equal(a, b) for a, b in zip(ga, gb))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert ida == idb
    assert torch.equal(ea, eb)
    assert int(sb["4.num_batches_tracked"]) == 5 * 4  # nn.BatchNorm counts each micro-batch of the 5 steps


def test_a_failing_stage_raises_its_own_error_in_the_caller_and_the_next_step_runs() -> None:
    model = nn.Sequential(nn.Linear(4, 8), Fault("backward", stage=0, microbatch=1), nn.Tanh(), nn.Linear(8, 2))
    pipe = GPipe(model, balance=[2, 2], chunks=3, schedule="1f1b", seed=11, local_stages="processes",
                 timeout=TIMEOUT)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    with pytest.raises(InjectedFault, match=r"injected fault in backward.*stage 0, backward of micro-batch 1") as err:
        pipe.train_step(x, y, F.mse_loss)
    assert any("stage process of rank 0" in note for note in err.value.__notes__)
    # the fault fires at step 0 only (a failed step is not counted): the same processes run step 1
    procs = _processes(pipe)
    assert torch.isfinite(pipe.train_step(x, y, F.mse_loss, step=1))
    assert _processes(pipe) == procs
    pipe.close()
    assert all(p.exitcode is not None for p in procs)


def test_a_stage_process_that_dies_is_named_and_the_next_step_starts_a_new_one() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ExitOnce(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    pipe = GPipe(model, balance=[2, 2], chunks=2, local_stages="processes", timeout=TIMEOUT)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    pipe.train_step(x, y, F.mse_loss)
    with pytest.raises(StageProcessLost, match=r"stage process of rank 0 ended.*exit code 3"):
        pipe.train_step(x + 1000, y, F.mse_loss)
    pipe.zero_grad()
    loss = pipe.train_step(x, y, F.mse_loss)
    want = F.mse_loss(model(x), y)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    procs = _processes(pipe)
    del pipe
    gc.collect()  # collecting the pipe stops its processes
    for p in procs:
        p.join(STOP_S * 2)
    assert all(p.exitcode is not None for p in procs)


def test_a_stage_process_that_hangs_ends_the_step_within_the_timeouts_and_the_next_step_runs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(HangOnce(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    pipe = GPipe(model, balance=[2, 2], chunks=2, local_stages="processes", timeout=2.0)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    pipe.train_step(x, y, F.mse_loss)  # starts the processes (within max(timeout, START_S))
    # the last rank's wait times out; the stage process reports its own stall within one more
    # timeout (its computation left hanging on a thread of its own, as a thread would be), or,
    # silent, is killed then: either way the step ends, and the next one runs
    with pytest.raises(PipelineTimeoutError, match=r"rank 1 waited for \('F', 1, 0\) from the stage process of rank 0"):
        pipe.train_step(x + 1000, y, F.mse_loss)
    loss = pipe.train_step(x, y, F.mse_loss)
    torch.testing.assert_close(loss, F.mse_loss(model(x), y), rtol=1e-5, atol=1e-5)
    pipe.close()


def test_bad_local_stages_values_are_refused_naming_what_is_allowed() -> None:
    with pytest.raises(OptionError, match=r"^local_stages: must be one of \['threads', 'processes', 'auto'\], "
                                          r"got 'fork'$"):
        GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), partitions=2, local_stages="fork")
    with pytest.raises(OptionError, match=r"pipeline\.local_stages: must be one of"):
        PipelineOptions(local_stages="process").check(prefix="pipeline.")
    with pytest.raises(OptionError, match=r"local_stages: 'processes' does not compile stages"):
        GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), partitions=2, local_stages="processes", compile=True)


def test_auto_trains_as_threads_while_it_tries_both_ways_and_then_keeps_one() -> None:
    torch.manual_seed(3)
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    results = {}
    for mode in ("threads", "auto"):
        model = _model()
        pipe = GPipe(model, partitions=2, chunks=4, schedule="1f1b", seed=7, local_stages=mode, timeout=TIMEOUT)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(len(AutoTrial().order) + 1):  # the trial's steps, then one of the way it kept
            opt.zero_grad()
            losses.append(pipe.train_step(x, y, F.mse_loss))
            opt.step()
        process_steps = pipe.executor.processes.serial if isinstance(pipe.executor, ProcessExecutor) else 0
        results[mode] = (losses, model.state_dict(), pipe.local_stages, process_steps)
        pipe.close()
    (la, sa, _, _), (lb, sb, chosen, process_steps) = results["threads"], results["auto"]
    assert chosen in ("threads", "processes")  # the trial ended with a choice (which: the machine's)
    # the warm-up and ROUNDS timed steps ran in stage processes, and so did the last step if they won
    assert process_steps == ROUNDS + 1 + (chosen == "processes")
    assert all(torch.equal(a, b) for a, b in zip(la, lb))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # where processes cannot run, auto is threads from the start
    compiled = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), partitions=2, local_stages="auto", compile=True)
    assert compiled.local_stages == "threads"


def test_a_stage_of_many_tensors_starts() -> None:
    """Each shared tensor's memory travels as a descriptor: 300 on one stage (the forkserver takes at
    most 256 with a process's start, so the layers go through the command pipe)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(151)])
    pipe = GPipe(model, balance=[150, 1], chunks=2, local_stages="processes", timeout=TIMEOUT)
    x, y = torch.randn(4, 2), torch.randn(4, 2)
    loss = pipe.train_step(x, y, F.mse_loss)
    torch.testing.assert_close(loss, F.mse_loss(model(x), y), rtol=1e-5, atol=1e-5)
    pipe.close()


@pytest.mark.parametrize(("schedule", "K", "v"), [("interleaved-1f1b", 2, 2), ("zb-h1", 3, 1)])
def test_interleaved_and_split_backward_schedules_match_threads(schedule: str, K: int, v: int) -> None:
    """Virtual stages (rank K-1 sends back to rank 0), W actions, and K=3: a pipe between two stage
    processes; two optimizer steps, parameters and losses bit for bit as threads'."""
    torch.manual_seed(5)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    seen = []
    for mode in ("threads", "processes"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.1)) for _ in range(K * v)])
        pipe = GPipe(model, partitions=K, chunks=4, schedule=schedule, virtual_stages=v, local_stages=mode, seed=1,
                     threads_per_stage=1, timeout=TIMEOUT)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(2):
            opt.zero_grad()
            losses.append(pipe.train_step(x, y, F.mse_loss))
            opt.step()
        pipe.close()
        seen.append((losses, [p.detach().clone() for p in model.parameters()]))
    (la, pa), (lb, pb) = seen
    assert all(torch.equal(a, b) for a, b in zip(la + pa, lb + pb))


def test_layers_that_do_not_pickle_are_refused_naming_the_way_out() -> None:
    class Local(nn.Linear):  # a class defined in a function cannot reach another process
        pass

    pipe = GPipe(nn.Sequential(Local(2, 2), nn.Linear(2, 2)), partitions=2, local_stages="processes",
                 timeout=TIMEOUT)
    with pytest.raises(TypeError, match=r"layers of rank 0 cannot be sent to its stage process .*"
                                        r"local_stages='threads'"):
        pipe.train_step(torch.randn(4, 2), torch.randn(4, 2), F.mse_loss)
    pipe.close()


def test_processes_refuse_a_v_placement_and_long_skips_and_auto_takes_threads() -> None:
    from gpipe_lab.bench.unet import unet

    def mlp() -> nn.Sequential:
        return nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])

    with pytest.raises(OptionError, match=r"local_stages: 'processes' places chunk j on rank j mod K.*'zb-v'"):
        GPipe(mlp(), balance=[1, 1, 1, 1], chunks=4, schedule="zb-v", virtual_stages=2, local_stages="processes")
    with pytest.raises(OptionError, match=r"local_stages: 'processes' .* long skips"):
        GPipe(unet(), partitions=3, chunks=2, local_stages="processes")
    pipe = GPipe(unet(), partitions=3, chunks=2, local_stages="auto")
    assert pipe.local_stages == "threads"
