"""``PipelineOptions``: every pipeline option, its one default and its check, defined once.

The same dataclass is the Hydra schema of ``conf/pipeline/`` (``pipeline.<field>``), the
argument of ``GPipeStrategy`` and of both engine front doors (``GPipe``,
``DistributedGPipe``). Errors name the option as the caller wrote it: ``chunks`` for the
engine, ``pipeline.chunks`` for the app (``check(prefix="pipeline.")``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from operator import attrgetter
from typing import Any

import torch

from gpipe_lab.pipeline.schedules import form_problem, schedule_names

CHECKPOINT_MODES = ("always", "except_last", "never")
NONFINITE_POLICIES = ("raise", "skip", "ignore")
TRANSPORTS = ("local", "distributed")
#: ``local_stages``: how the local transport runs its ranks
LOCAL_STAGES = ("threads", "processes", "auto")
REPLAY_SETTINGS = ("auto", True, False)
#: ``track_memory``: count once per forward signature and reuse, count every forward, do not count
MEMORY_SETTINGS = (True, "every_step", False)


class OptionError(ValueError):
    """A pipeline option with a value that cannot run; the message starts with the option's key."""


@dataclass
class PipelineOptions:
    """How a layer sequence is pipelined. Every field is a ``pipeline.<name>`` config key."""

    #: K stages, balanced automatically by ``cost``; ``None``: ``len(balance)``, else 1.
    partitions: int | None = None
    #: layers per stage, e.g. ``[3, 5]`` (instead of ``partitions``).
    balance: list[int] | None = None
    #: M micro-batches per mini-batch (fewer when a batch has fewer samples).
    chunks: int = 4
    #: re-materialization: ``always``, ``except_last`` or ``never``.
    checkpoint: str = "except_last"
    #: a schedule name from ``gpipe_lab.pipeline.schedules`` (``gpipe``, ``1f1b``, ...).
    schedule: str = "gpipe"
    #: v model chunks per pipeline rank (interleaved schedules); 1 otherwise.
    virtual_stages: int = 1
    #: ``local`` (a thread per stage) or ``distributed`` (a process per stage).
    transport: str = "local"
    #: local transport: ``threads`` (a thread per rank, one process), ``processes`` (every rank but
    #: the last in a process of its own on this machine, tensors in shared memory: CPU stages, no
    #: ``compile``; README "Stage processes"), or ``auto`` (the first training steps try both, same
    #: results bit for bit, and the faster stays; threads where processes cannot run).
    local_stages: str = "threads"
    #: normalize each micro-batch by its own statistics; running statistics per mini-batch.
    deferred_batch_norm: bool = False
    #: per-layer cost for the automatic balance: ``auto``, ``params``, ``flops``, ``activation_bytes``,
    #: ``output_bytes``, ``time`` (the last four measured on an example input, the front door's
    #: ``sample=``; ``time``: forward + backward seconds at the micro-batch size, which varies
    #: between runs), or a list of numbers. ``auto``: FLOPs on ``sample=`` when given, else
    #: parameters (``measuring.costs.AUTO_MEASURED``).
    cost: Any = "auto"
    #: base seed of the per-(step, stage, micro-batch) generators; ``None``: torch's initial seed.
    seed: int | None = None
    #: local transport: one device per stage (``None``: CPU, or the trainer's devices); distributed:
    #: one replica's, the node's other replicas shifted past them (``resolve.stage_device``).
    devices: list[str] | None = None
    #: intra-op threads of each CPU stage (``None``: the free cores / CPU stages, at least 1: the
    #: cores this process may use less what other processes keep busy, ``pipeline.cpu_share``).
    threads_per_stage: int | None = None
    #: seconds a stage may wait for a neighbour before the step fails.
    timeout: float = 300.0
    #: a NaN/inf loss or gradient: ``raise`` NonFiniteError, ``skip`` the step, or ``ignore``.
    nonfinite: str = "raise"
    #: how a stage forward's random draws come from its per-(step, stage, micro-batch) generators,
    #: so re-materialization repeats them and runs do not depend on thread timing (README, "Random
    #: replay"). ``auto``: a stage that alone uses its device's generator reseeds it per micro-batch;
    #: CPU stage threads take the per-op replay mode only where a first-step probe found draws
    #: outside ``nn.Dropout``, and raise if such a draw appears later. ``true``: the per-op mode on
    #: every forward (one Python hop per op). ``false``: only ``nn.Dropout`` (``StageDropout``) is replayed.
    random_replay: bool | str = "auto"
    #: compile each stage's module with ``torch.compile``: ``false``, ``true``, or a dict of its
    #: keywords (``mode``, ``dynamic``, ``backend`` ...). A compiled stage replays only
    #: ``nn.Dropout`` draws (see ``compiling``); it raises for any other draw. The first steps
    #: compile, and a neighbour's wait for it counts against ``timeout``: raise it for large stages.
    compile: Any = False
    #: count saved-activation bytes per stage (``memory()``) with saved-tensor hooks: ``true`` counts
    #: the first forward of each signature (input shapes, grad and autocast modes ...) and reuses it,
    #: ``every_step`` counts every forward (saved tensors whose size depends on values), ``false`` none.
    track_memory: bool | str = True
    #: CPU stages: keep freed memory in the process for the next step (glibc ``mallopt``).
    retain_cpu_memory: bool = True

    def check(self, prefix: str = "") -> PipelineOptions:
        """Check every option on its own (combinations with a model are the caller's).

        Returns ``self`` for chaining.

        Raises:
            OptionError: naming ``prefix + key``, the value and what is allowed.
        """
        def fail(key: str, what: str) -> None:
            raise OptionError(f"{prefix}{key}: {what}, got {getattr(self, key)!r}")

        def positive_int(key: str, optional: bool = False) -> None:
            value = getattr(self, key)
            if value is None and optional:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(key, "must be an integer >= 1")

        positive_int("partitions", optional=True)
        positive_int("chunks")
        positive_int("virtual_stages")
        positive_int("threads_per_stage", optional=True)
        if self.balance is not None:
            if (isinstance(self.balance, (str, bytes)) or not isinstance(self.balance, Sequence)
                    or not self.balance
                    or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in self.balance)):
                fail("balance", "must be a non-empty list of positive layer counts")
            v = self.virtual_stages if isinstance(self.virtual_stages, int) and self.virtual_stages > 0 else 1
            if self.partitions is not None and self.partitions * v != len(self.balance):
                per = "" if v == 1 else f" × {prefix}virtual_stages={v}"
                raise OptionError(f"{prefix}balance: {list(self.balance)} has {len(self.balance)} entries but "
                                  f"{prefix}partitions={self.partitions}{per}; give one of them, or make them agree")
        if self.checkpoint not in CHECKPOINT_MODES:
            fail("checkpoint", f"must be one of {list(CHECKPOINT_MODES)}")
        if self.schedule not in schedule_names():
            fail("schedule", f"must be one of {schedule_names()}")
        problem = form_problem(self.schedule, self.virtual_stages)
        if problem is not None:
            fail("virtual_stages", problem)
        if self.transport not in TRANSPORTS:
            fail("transport", f"must be one of {list(TRANSPORTS)}")
        if self.local_stages not in LOCAL_STAGES:
            fail("local_stages", f"must be one of {list(LOCAL_STAGES)}")
        if not isinstance(self.random_replay, (bool, str)) or self.random_replay not in REPLAY_SETTINGS:
            fail("random_replay", f"must be one of {list(REPLAY_SETTINGS)}")
        if not isinstance(self.track_memory, (bool, str)) or self.track_memory not in MEMORY_SETTINGS:
            fail("track_memory", f"must be one of {list(MEMORY_SETTINGS)}")
        if self.nonfinite not in NONFINITE_POLICIES:
            fail("nonfinite", f"must be one of {list(NONFINITE_POLICIES)}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) \
                or not (self.timeout > 0 and math.isfinite(self.timeout)):
            fail("timeout", "must be a finite number of seconds > 0")
        if self.compile is not False and self.compile is not True:
            try:
                compile_kwargs(self.compile)
            except ValueError as error:
                raise OptionError(f"{prefix}{error}") from None
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            fail("seed", "must be an integer or null")
        return self

    @property
    def num_stages(self) -> int:
        """K: the balance's length over ``virtual_stages``, else ``partitions``, else 1."""
        if self.balance is not None:
            return len(self.balance) // max(1, int(self.virtual_stages))
        return int(self.partitions or 1)

    def replace(self, **changes: Any) -> PipelineOptions:
        """A copy with ``changes`` applied; a sequence given for ``balance`` or ``devices`` is
        stored as a list (devices as strings, e.g. ``"cuda:1"``).

        Raises:
            OptionError: a name that is not a field, naming the allowed ones.
        """
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise OptionError(f"{unknown[0]}: unknown pipeline option; allowed: "
                              f"{', '.join(f.name for f in fields(self))}")
        for key, convert in (("balance", lambda x: x), ("devices", str)):
            value = changes.get(key)
            if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
                changes[key] = [convert(x) for x in value]
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compile_kwargs(value: object, key: str = "compile") -> dict[str, Any] | None:
    """``torch.compile``'s keyword arguments for a ``compile`` option; ``None``: do not compile.

    Raises:
        ValueError: ``value`` is not a bool or a mapping of ``torch.compile`` keywords
            (the message names ``key``, the value and the allowed keywords).
    """
    if value is False or value is None:
        return None
    if value is True:
        return {}
    allowed = [p for p in inspect.signature(torch.compile).parameters if p != "model"]
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}: must be true, false or a dict of torch.compile keywords "
                         f"({', '.join(allowed)}), got {value!r}")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise ValueError(f"{key}: {unknown[0]!r} is not a torch.compile keyword; allowed: {', '.join(allowed)}")
    return dict(value)


def merged_options(options: PipelineOptions | None, overrides: dict[str, Any]) -> PipelineOptions:
    """``options`` (default ``PipelineOptions()``) with the keyword ``overrides`` applied.

    The one place where the front doors' convenience keywords meet the options: a keyword
    is a field name, its value replaces that field (``None`` included).

    Raises:
        OptionError: ``options`` is not a ``PipelineOptions``, or a keyword is not a field.
    """
    if options is not None and not isinstance(options, PipelineOptions):
        raise OptionError(f"options: must be a PipelineOptions, got {type(options).__name__}")
    base = options if options is not None else PipelineOptions()
    return base.replace(**overrides)


__all__ = ["CHECKPOINT_MODES", "LOCAL_STAGES", "NONFINITE_POLICIES", "TRANSPORTS", "OptionError", "PipelineOptions",
           "compile_kwargs", "forwarded", "merged_options"]


# Read-only properties over another object's fields (the engine's options, a rank's topology, the
# strategy's options), so that each such attribute is one line, not a block.
def forwarded(path: str, doc: str | None = None) -> property:
    """A read-only property returning ``self.<path>`` (``path`` may be dotted).

    Raises:
        ValueError: ``path`` is empty.
    """
    if not path:
        raise ValueError("forwarded: path must name an attribute, got ''")
    get = attrgetter(path)
    return property(lambda self: get(self), doc=doc or f"``self.{path}`` (read-only).")


class OptionViews:
    """Read-only attributes over ``self.options``, shared by the engine core and the strategy."""

    options: PipelineOptions
    virtual_stages = forwarded("options.virtual_stages", "v: model chunks per pipeline rank.")
    chunks = forwarded("options.chunks", "M: micro-batches per mini-batch (fewer when a batch is smaller).")
    checkpoint = forwarded("options.checkpoint", "The re-materialization mode.")
    schedule = forwarded("options.schedule", "The schedule's name.")
    nonfinite = forwarded("options.nonfinite", "What a NaN/inf step does: raise, skip or ignore.")
    timeout = forwarded("options.timeout", "Seconds a stage may wait for a neighbour.")
