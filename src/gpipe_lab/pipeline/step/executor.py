"""The one executor: a thread per hosted rank walks its actions over an endpoint and one mailbox.

Both transports run a step here (``channel.Endpoint`` is all that differs):

* one thread per pipeline rank this process hosts (every rank locally, its own
  under torch.distributed), named ``gpipe-stage-<rank>``, walks the rank's list
  through ``channel.run_action``; the threads live across steps (``workers``);
* every incoming value is taken from one ``Mailbox`` keyed by message; each
  wait is bounded by the endpoint's ``timeout`` on its own (a per-wait limit),
  and the sender it waits for comes from the schedule walker
  (``schedules.expected_messages``);
* what an action consumes and produces is derived once per schedule
  (``_plan``), not per action: a step's per-action work is the compute, the
  hand-over and a few stores (the scheduling overhead of small layers);
* once a stage's gradients are final (its last backward, and the endpoint's data-parallel
  sync where it ends then), its thread launches the stage's non-finite check (``stage_flags``);
* a stage back-propagates on its own thread: autograd multithreading is off
  there, so the engine never queues a stage's CUDA nodes to the device worker
  thread, which in ``pipe(x).backward()`` is the caller waiting for this thread;
* the caller's wait for the threads is bounded too: a whole timeout in which no
  rank ended an action or a wait, and none is waiting (a waiting rank times out
  by itself, naming its peer), raises ``PipelineTimeoutError``;
* failure is handled here alone: the first exception stops the mailbox (every
  waiting rank wakes) and the failing thread has the endpoint announce it to other
  processes (``announce``; each rank polls the endpoint before every action), all
  threads end, runtimes drop what the step left, and the endpoint turns the
  exception into the error raised (annotated).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from functools import partial

import torch

from gpipe_lab.pipeline.errors import PipelineTimeoutError
from gpipe_lab.pipeline.measuring.step_timeline import Event, Timeline
from gpipe_lab.pipeline.schedules import Action, MessageKey, Schedule
from gpipe_lab.pipeline.skip.transport import skip_senders
from gpipe_lab.pipeline.stage.checkpointing import autocast_as
from gpipe_lab.pipeline.stage.runtime import StageRuntime
from gpipe_lab.pipeline.step.channel import Endpoint, RankDevices, StepFeed, Values, run_action
from gpipe_lab.pipeline.step.mailbox import Stopped, Undelivered, WaitTimeout
from gpipe_lab.pipeline.step.stage_flags import StageFlags
from gpipe_lab.pipeline.step.step_state import ExecutionPlan, Stalled, StepState
from gpipe_lab.pipeline.step.workers import StageWorkers


class Executor:
    """Runs the hosted ranks' action lists of ``PipelineCore``'s steps over ``endpoint``."""

    def __init__(self, endpoint: Endpoint, runtimes: Mapping[int, StageRuntime]) -> None:
        self.endpoint = endpoint
        self.runtimes = dict(runtimes)
        self.num_stages = next(iter(self.runtimes.values())).num_stages
        self._plans: dict[int, ExecutionPlan] = {}
        self.workers = StageWorkers()  # long-lived: thread-local caches (cuDNN's) survive steps
        self.stage_flags = StageFlags()  # armed and taken by the core, per step

    def _plan(self, schedule: Schedule) -> ExecutionPlan:
        """The plan of ``schedule``, made on its first step (the core caches its schedules)."""
        plan = self._plans.get(id(schedule))
        if plan is None or plan.schedule is not schedule:
            plan = self._plans[id(schedule)] = ExecutionPlan(schedule, self.num_stages, self.runtimes)
            plan.senders.update(skip_senders(schedule, self.runtimes))
        return plan

    def run(self, schedule: Schedule, prepared: object, feed: StepFeed, sync_gradients: bool) -> None:
        """Execute the hosted ranks' lists of ``schedule``.

        Raises:
            Exception: the first exception of any rank, with its original type, once every rank
                thread has stopped, annotated by the endpoint with stage and action.
            PipelineTimeoutError: a wait lasted longer than the timeout (a subclass names the peer),
                or no rank progressed for a whole timeout; a rank still inside a computation then
                ends by itself at its next action (compute cannot be interrupted).
            KeyboardInterrupt: the caller was interrupted (every rank thread stopped first).
        """
        step = StepState(self._plan(schedule), feed, sync_gradients)
        ranks = [(k, self._device(schedule, k)) for k in self.endpoint.ranks]
        step.hosting(len(ranks))
        self.endpoint.peak_live = {s: 0 for s in self.runtimes}
        self.endpoint.open(prepared, step.mailbox, ranks)
        try:
            self._run_threads(step, ranks)
        except Stalled as stalled:  # reported with the ranks' own failures, if any came first
            step.failures.append((time.monotonic(), ranks[0][0], None, stalled.error))
        except BaseException as exc:  # the caller was interrupted: the threads have stopped
            self._abort(ranks)
            raise self.endpoint.fail(exc, self._stage_of(schedule, ranks[0][0]), None) from None
        if not step.failures:
            try:
                self.endpoint.close(ranks, ok=True, sync_gradients=sync_gradients)
                return
            except BaseException as exc:  # noqa: BLE001 - a send or an all-reduce failed
                step.failures.append((time.monotonic(), ranks[0][0], None, exc))
        self._abort(ranks)
        _, k, action, error = step.first_failure()
        stage = self._stage_of(schedule, k) if action is None else action.stage
        raise self.endpoint.fail(error, stage, action) from None

    def _run_threads(self, step: StepState, ranks: RankDevices) -> None:
        """Start a thread per rank and wait until all have ended (also when interrupted).

        One local CPU stage of several intra-op threads runs on the caller's thread instead:
        libgomp gives every thread that starts a parallel region a team of its own, and a stage
        team beside the caller's slows each small parallel region of the stage (once the caller has
        run a multi-threaded op, the two teams contend for the same cores). Such a step has no neighbour to wait for, so only a computation that never returns
        could hold it, as it would hold plain PyTorch; with one thread (no team) the stage keeps
        its worker, and a stuck computation is reported after ``timeout``.
        """
        main_threads = torch.get_num_threads()
        threads = self.endpoint.threads_per_rank
        if (len(ranks) == 1 and ranks[0][1].type == "cpu" and self.endpoint.holds_all_stages
                and threads is not None and threads > 1):
            try:
                self._rank_thread(step, *ranks[0])
            finally:
                torch.set_num_threads(main_threads)
            return
        launched: list[int] = []
        try:
            for k, device in ranks:
                launched.append(k)
                self.workers.submit(k, partial(self._rank_thread, step, k, device))
            for k in launched:
                self._wait_for(step, k)
        except BaseException:  # e.g. Ctrl-C in the caller: stop the threads before re-raising
            # A task queued but not begun (a Ctrl-C can land inside submit) will not run; a running
            # one stops at its next action or wait (its compute cannot be interrupted): wait for it.
            step.cancel()
            for k in launched:
                if step.running[k].is_set():
                    step.finished[k].wait(self.endpoint.timeout)
            raise
        finally:
            torch.set_num_threads(main_threads)

    def _wait_for(self, step: StepState, k: int) -> None:
        """Wait for rank ``k``'s thread to end while some rank progresses.

        Raises:
            PipelineTimeoutError: for a whole timeout no rank finished an action or a wait, and
                none is waiting (a computation longer than the timeout, or a backward that can
                never be scheduled).
        """
        seen = step.progress
        while not step.finished[k].wait(self.endpoint.timeout):
            waiting = any(w and not step.finished[r].is_set() for r, w in enumerate(step.waiting))
            if step.progress == seen and not waiting:  # a waiting rank times out by itself
                raise Stalled(PipelineTimeoutError(self.endpoint.timeout, list(step.done),
                                                    list(step.current), "no stage progressed"))
            seen = step.progress

    def _rank_thread(self, step: StepState, k: int, device: torch.device) -> None:
        if not step.begin(k):
            step.finished[k].set()
            return
        try:
            with ExitStack() as stack:
                stack.enter_context(autocast_as(step.autocast))
                # thread-local, and takes effect when made: the stage's backward runs on this thread
                stack.enter_context(torch.autograd.set_multithreading_enabled(False))
                if device.type == "cpu" and self.endpoint.threads_per_rank is not None:
                    torch.set_num_threads(self.endpoint.threads_per_rank)
                elif device.type == "cuda":
                    torch.cuda.set_device(device)
                stack.enter_context(self.endpoint.rank_context(k, device))
                self._walk(step, k)
                step.leave_together(self.endpoint.timeout)
        except Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            step.fail(k, exc)
        finally:
            step.finished[k].set()

    def _walk(self, step: StepState, k: int) -> None:
        """Run rank ``k``'s program (``ExecutionPlan.ranks``: what each action needs, looked up once)."""
        endpoint, feed, mailbox, poll = self.endpoint, step.feed, step.mailbox, self.endpoint.poll
        peak = endpoint.peak_live
        done, current, sync, flags = step.done, step.current, step.sync_gradients, self.stage_flags

        def receive(key: MessageKey, action: Action) -> tuple[Values, bool]:
            return self._receive(step, k, key, action)

        try:
            for action, runtime, key, out, last_of_stage, following in step.plan.ranks[k]:
                if mailbox.stopped:  # another rank failed or the caller was interrupted
                    raise Stopped
                poll()  # another process failed: stop before this action, not at the next wait
                run_action(action, runtime, receive, endpoint, feed, key, out)
                live = runtime.live_microbatches()
                if live > peak[action.stage]:
                    peak[action.stage] = live
                if sync and last_of_stage and endpoint.stage_done(runtime):
                    flags.stage_final(runtime)  # its check overlaps earlier stages' backward
                done[k] = action
                current[k] = following
                step.progress += 1
        except Stopped:
            raise
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            # recorded (the mailbox stopped) and announced to other processes before this thread
            # leaves its contexts: the other ranks stop at their next action (torchgpipe's early stop)
            step.fail(k, exc)
            endpoint.announce(exc, action.stage, step.current[k])
            raise Stopped from None

    def _receive(self, step: StepState, k: int, key: MessageKey, action: Action) -> tuple[Values, bool]:
        """Wait (bounded) for ``key``; the time blocked is a ``wait`` event of the stage."""
        start = time.perf_counter()
        step.waiting[k] = True
        try:
            item = step.mailbox.get(key, self.endpoint.timeout, self.endpoint.poll)
        except WaitTimeout:
            raise self.endpoint.timed_out(key, action, step.senders[key], list(step.done),
                                          list(step.current)) from None
        except Undelivered as lost:
            raise self.endpoint.undelivered(key, action, lost.peer, lost.cause) from None
        # cleared only after a value came: a failed wait stays marked until its thread has ended
        step.waiting[k] = False
        runtime = self.runtimes[action.stage]
        runtime.events.append((action.stage, "wait", action.microbatch, start, time.perf_counter()))
        step.progress += 1
        return self.endpoint.receive(item, runtime)

    def _abort(self, ranks: RankDevices) -> None:
        """Drop what a failed step left behind (never raises)."""
        self.endpoint.close(ranks, ok=False, sync_gradients=False)
        for runtime in self.runtimes.values():
            runtime.abort()

    def _device(self, schedule: Schedule, k: int) -> torch.device:
        return self.runtimes[schedule[k][0].stage].device if schedule[k] else torch.device("cpu")

    def _stage_of(self, schedule: Schedule, k: int) -> int:
        return schedule[k][0].stage if schedule[k] else k


class StepRecord:
    """What a step's timeline is made of, kept as recorded at the step's end: the stages record
    plain tuples while they run, and the ``Timeline`` is built only when someone reads it."""

    def __init__(self, runtimes: Mapping[int, StageRuntime], placement: Sequence[int], start: float,
                 num_microbatches: int) -> None:
        self.end = time.perf_counter()
        self.held = list(runtimes.values())
        self.recorded = [r.events for r in self.held]  # each step gives a runtime a new list
        self.placement, self.start, self.num_microbatches = placement, start, num_microbatches

    def timeline(self) -> Timeline:
        """The step's ``Timeline`` (events sorted by start, stage numbers as the pipeline ranks that
        hold them, per the schedule's placement)."""
        rank = self.placement
        timeline = Timeline(max(rank) + 1, start=self.start)
        timeline.end = self.end
        timeline.events = sorted((Event(rank[s], kind, mb, t0, t1) for events in self.recorded
                                  for s, kind, mb, t0, t1 in events), key=lambda e: e.start)
        timeline.num_microbatches = self.num_microbatches
        if any(r.clock is not None for r in self.held):
            held = self.held
            timeline.device_source = lambda: [Event(rank[e.stage], e.kind, e.microbatch, e.start, e.end)
                                              for r in held for e in r.device_events()]
        return timeline
