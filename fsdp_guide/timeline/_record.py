"""One training step in time: bytes per category and collectives on one axis (private).

torch's profiler does the measuring: with ``profile_memory=True`` it records every CPU (and
CUDA) allocation and free, and its memory profile (what ``export_memory_timeline`` writes)
sorts each tensor into parameters, gradients, optimizer state, activations and temporaries.
Two things are added here. Tensors that existed before the step (the model state) are
labelled from :func:`fsdp_guide.memory.measure_model_state`, since the profile cannot tell
an FSDP shard from any other pre-existing tensor; and each collective runs inside a
``record_function`` named for its kind and payload bytes, through a ``TorchDispatchMode`` over
``torch.ops.c10d``, so it lands on the profiler's own clock and in the Chrome trace.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_guide._own_allocations import OwnAllocations, own_allocations
from fsdp_guide.comm import payload_of
from fsdp_guide.timeline._quiet import native_stderr_closed, native_stderr_filtered, quiet

#: The categories of a timeline, in the order tables and plots show them.
CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
PHASES = ("forward", "backward", "optimizer step")
_MARK = "fsdp_guide:"
# The memory profile's columns (torch.profiler's export_memory_timeline JSON): a leading 0,
# then parameter, optimizer state, input, temporary, activation, gradient, autograd detail,
# and tensors it could not categorise.
_COLUMNS = (
    None,
    "params",
    "optimizer",
    "activations",
    "temporaries",
    "activations",
    "grads",
    "temporaries",
    None,
)


@dataclass(frozen=True, kw_only=True)
class CollectiveEvent:
    """One collective of the step.

    Attributes:
        kind: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ...
        bytes: Payload bytes (the full tensor gathered or reduce-scattered, the tensor reduced).
        start_us: When it started, microseconds from the start of the step.
        end_us: When it returned.
    """

    kind: str
    bytes: int
    start_us: float
    end_us: float


@dataclass(frozen=True, kw_only=True)
class StepTimeline:
    """A rank's allocated bytes over one training step, by category, and its collectives.

    Attributes:
        times_us: Instants at which the allocated bytes changed, microseconds from the start.
        bytes: For each of :data:`CATEGORIES`, the bytes held at each instant.
        phases: ``(name, start_us, end_us)`` of forward, backward and the optimizer step.
        collectives: Every collective, in the order issued.
        state_before: Bytes of model state held when the step began (they are in
            ``bytes`` from the first instant on).
        categorised: ``False`` where torch's memory profile could not sort the step's
            tensors (it rejects FSDP1's flat-parameter graphs): what the step allocates is
            then all counted as temporaries, its total still exact.
        unreleased: Bytes the step allocated and had not released by its end, as the
            profiler saw it. A step after the first releases all it allocates, so more
            than 0 means a release went unseen: gloo's worker threads let go of a
            collective's buffers after their work has run, where the profiler does not
            follow them, and the buffer then looks held to the end. Such a step's peak can
            carry a block it did not hold; record another.

    Examples:
        >>> t = StepTimeline(times_us=(0.0, 1.0), bytes={c: (1, 2) for c in CATEGORIES},
        ...                  phases=(), collectives=(), state_before=5)
        >>> t.total, t.peak, t.peak_split()["grads"]
        ((5, 10), 10, 2)
    """

    times_us: tuple[float, ...]
    bytes: Mapping[str, tuple[int, ...]]
    phases: tuple[tuple[str, float, float], ...]
    collectives: tuple[CollectiveEvent, ...]
    state_before: int
    categorised: bool = True
    unreleased: int = 0

    @property
    def total(self) -> tuple[int, ...]:
        """Allocated bytes at each instant, all categories."""
        return tuple(sum(col) for col in zip(*self.bytes.values(), strict=True))

    @property
    def peak(self) -> int:
        """The most bytes allocated at once during the step."""
        return max(self.total)

    @property
    def peak_index(self) -> int:
        """The first instant at which :attr:`peak` is reached."""
        return self.total.index(self.peak)

    def peak_split(self) -> dict[str, int]:
        """The bytes of each category at the peak."""
        i = self.peak_index
        return {c: self.bytes[c][i] for c in CATEGORIES}

    def phase_at(self, time_us: float) -> str:
        """The phase running at ``time_us`` (``""`` outside them)."""
        return next((n for n, a, b in self.phases if a <= time_us <= b), "")

    def collective_bytes(self) -> dict[str, int]:
        """Payload bytes per kind of collective, over the step."""
        out: dict[str, int] = {}
        for event in self.collectives:
            out[event.kind] = out.get(event.kind, 0) + event.bytes
        return out

    def plot(self, title: str = "", path: str | os.PathLike[str] | None = None) -> Any:
        """Draw the step: each category's bytes stacked over it, the phases shaded, the peak
        marked, and every collective on the same axis underneath.

        Args:
            title: Drawn above the plot.
            path: Where to write a PNG; ``None`` to only return the figure.

        Returns:
            The matplotlib ``Figure`` (matplotlib is imported here).
        """
        from fsdp_guide.timeline._plot import plot_step  # matplotlib only when drawing

        return plot_step(self, title, path)


class _Marked(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs each c10d op inside a ``record_function`` naming its kind and payload bytes."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        found = payload_of(func, args)
        if found is None or found[0] == "barrier":
            return func(*args, **(kwargs or {}))
        kind, _, size, _, _ = found
        with torch.profiler.record_function(f"{_MARK}{kind}:{size}"):
            return func(*args, **(kwargs or {}))


#: A step releases all it allocates but its loss (a few bytes): more unreleased than this is a
#: release the profiler did not see.
_LOST = 64


def _profiled(
    forward: Callable[[], Any], backward: Callable[[Any], None], step: Callable[[], None]
) -> torch.profiler.profile:
    """One training step under torch's profiler, its own notices kept out of the output."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(
        activities=activities, profile_memory=True, record_shapes=True, with_stack=True
    )
    # The cyclic garbage collector runs when allocation counts say so, freeing tensors held
    # in reference cycles (autograd graphs, FSDP's hooks) at moments that differ from run to
    # run: off during the step, so the same step allocates the same bytes every time.
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    with native_stderr_closed():
        profiler.start()
    try:
        with native_stderr_filtered(), _Marked():  # type: ignore[no-untyped-call]
            with torch.profiler.record_function(f"{_MARK}forward"):
                out = forward()
            with torch.profiler.record_function(f"{_MARK}backward"):
                backward(out)
            with torch.profiler.record_function(f"{_MARK}optimizer step"):
                step()
    finally:
        with native_stderr_closed():
            profiler.stop()
        if gc_was_enabled:
            gc.enable()
    return profiler


def _lost_anywhere(lost: bool, device: torch.device) -> bool:
    """Whether any rank's step lost a release (this rank's answer outside a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return lost
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([int(lost)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def record_step(
    forward: Callable[[], Any],
    backward: Callable[[Any], None],
    step: Callable[[], None],
    *,
    state_before: Mapping[str, int],
    trace_path: str | os.PathLike[str] | None = None,
    attempts: int = 1,
) -> StepTimeline:
    """Run one training step under torch's profiler and return its timeline on this rank.

    Call it on every rank (the step's collectives need them all), on a step after the first,
    so that the optimizer state already exists.

    Args:
        forward: Runs the forward pass and returns what ``backward`` takes (the loss).
        backward: Runs the backward pass.
        step: Runs the optimizer step (for a DeepSpeed engine, ``engine.step``).
        state_before: Bytes of model state held before the step, by category: ``params``,
            ``grads``, ``optimizer`` (the fields of
            :func:`~fsdp_guide.memory.measure_model_state`'s result; a separate master copy
            or buckets count as ``optimizer`` and ``grads``).
        trace_path: Where to write the profiler's Chrome trace (open it in Perfetto or
            ``chrome://tracing``); ``None`` for none.
        attempts: How many steps to record at most. A step whose profile lost the release
            of a buffer (:attr:`StepTimeline.unreleased` over a few bytes on any rank) is
            followed by another, up to this many, and the one that lost the least is
            returned. Pass the same value on every rank: the ranks agree, by a collective,
            on whether to record another step.

    Returns:
        The step's timeline (a ``StepTimeline``).

    Raises:
        ValueError: For a category of ``state_before`` outside ``params``, ``grads``,
            ``optimizer``, or a negative byte count; for ``attempts`` below 1.
    """
    bad = {k: v for k, v in state_before.items() if k not in CATEGORIES[:3] or v < 0}
    if bad:
        raise ValueError(f"state_before takes bytes >= 0 of params, grads and optimizer; got {bad}")
    if attempts < 1:
        raise ValueError(f"attempts is how many steps to record at most, 1 or more; got {attempts}")
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    kept: tuple[torch.profiler.profile, OwnAllocations] | None = None
    for attempt in range(attempts):
        profiler = _profiled(forward, backward, step)
        # Only the calling thread's allocations: gloo's worker threads allocate staging
        # copies that they free at moments that differ from run to run.
        own = own_allocations(profiler, f"{_MARK}forward", device)
        if kept is None or own.unreleased < kept[1].unreleased:
            kept = (profiler, own)
        if attempt == attempts - 1 or not _lost_anywhere(own.unreleased > _LOST, device):
            break
    assert kept is not None  # the loop ran at least once
    profiler, own = kept
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.fspath(trace_path) if trace_path else os.path.join(tmp, "trace.json")
        profiler.export_chrome_trace(trace)
        with open(trace) as f:
            trace_json = json.load(f)
    # The memory profile counts microseconds since the epoch; the trace from its own base.
    base = float(trace_json.get("baseTimeNanoseconds", 0)) / 1000
    try:
        with quiet():
            times, sizes = _categorised(profiler, device, own.foreign)
        categorised = True
    except Exception:
        # The memory profile rejects some graphs (an assertion on FSDP1's flat parameters,
        # on DeepSpeed's hooks, now and then on FSDP2's): the allocation events still give
        # the exact total, the step's own bytes uncategorised.
        times, sizes = _uncategorised(own.events, base)
        categorised = False
    timeline = _timeline(times, sizes, trace_json["traceEvents"], base, state_before)
    return replace(timeline, categorised=categorised, unreleased=own.unreleased)


def _categorised(
    profiler: torch.profiler.profile, device: torch.device, foreign: frozenset[int]
) -> tuple[list[float], list[list[int]]]:
    """Rows of bytes per column of the memory profile (what ``export_memory_timeline``
    writes), without the blocks other threads allocated."""
    from torch.profiler._memory_profiler import (
        _CATEGORY_TO_INDEX,
        Action,
        MemoryProfileTimeline,
        TensorKey,
    )

    profile = MemoryProfileTimeline(profiler._memory_profile())
    times: list[float] = []
    sizes: list[list[int]] = []
    earliest = -1.0
    for t_ns, action, (key, version), nbytes in profile.timeline:
        if key.device != device:
            continue
        if isinstance(key, TensorKey) and key.storage.allocation_id in foreign:
            continue
        t = -1.0 if t_ns == -1 else float(t_ns // 1000)
        if t > 0 and (earliest < 0 or t < earliest):
            earliest = t
        if not times or t != times[-1]:
            times.append(t)
            sizes.append(sizes[-1].copy() if sizes else [0] * len(_COLUMNS))

        def add(v: int, delta: int, k: Any = key) -> None:
            category = profile.categories.get(k, v) if isinstance(k, TensorKey) else None
            sizes[-1][_CATEGORY_TO_INDEX[category] + 1] += int(delta)

        if action in (Action.PREEXISTING, Action.CREATE):
            add(version, nbytes)
        elif action == Action.INCREMENT_VERSION:
            add(version, -nbytes)
            add(version + 1, nbytes)
        else:
            add(version, -nbytes)
    return [earliest if t < 0 else t for t in times], sizes


def _uncategorised(
    events: tuple[tuple[int, int], ...], base: float
) -> tuple[list[float], list[list[int]]]:
    """Rows of the memory profile's shape from the allocation events, all of them in its
    last column (tensors it could not categorise)."""
    times, sizes, held = [base], [[0] * len(_COLUMNS)], 0
    for t_ns, nbytes in events:
        held += nbytes
        times.append(t_ns / 1000)
        sizes.append([0] * (len(_COLUMNS) - 1) + [held])
    return times, sizes


def _timeline(
    times: list[float],
    sizes: list[list[int]],
    events: list[dict[str, Any]],
    base: float,
    state_before: Mapping[str, int],
) -> StepTimeline:
    marks = sorted(
        (e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(_MARK)),
        key=lambda e: float(e["ts"]),
    )
    origin = float(marks[0]["ts"]) if marks else float(times[0]) - base
    phases, collectives = [], []
    for e in marks:
        name = e["name"][len(_MARK) :]
        start, end = float(e["ts"]) - origin, float(e["ts"]) + float(e["dur"]) - origin
        if ":" in name:
            kind, size = name.split(":")
            collectives.append(
                CollectiveEvent(kind=kind, bytes=int(size), start_us=start, end_us=end)
            )
        else:
            phases.append((name, start, end))
    # The first row holds the tensors that existed before the step and that it touched;
    # the profile cannot tell an FSDP shard from any other, so that row is replaced by the
    # measured state, and what the step adds is taken category by category.
    first = sizes[0] if sizes else []
    columns: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    for row in sizes:
        per = {c: state_before.get(c, 0) for c in CATEGORIES}
        for i, (column, value) in enumerate(zip(_COLUMNS, row, strict=True)):
            per[column or "temporaries"] += value - first[i]
        for c in CATEGORIES:
            columns[c].append(per[c])
    return StepTimeline(
        times_us=tuple(max(0.0, float(t) - base - origin) for t in times),
        bytes={c: tuple(v) for c, v in columns.items()},
        phases=tuple(phases),
        collectives=tuple(collectives),
        state_before=sum(state_before.values()),
    )
