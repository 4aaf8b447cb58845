"""When each FSDP2 unit holds its full parameters over one step, event by event (private).

An FSDP2 unit's parameters are ``DTensor`` shards while it is sharded and plain tensors while
it is gathered, so looking at one parameter of each unit tells which units are gathered. This
is done at every collective the rank issues (seen through a ``TorchDispatchMode``), as each
unit's forward starts, and each time autograd saves or uses a tensor (a unit gathered and
freed between two collectives shows there). Each all-gather is then matched to the unit it
gathers and each reduce-scatter to the unit whose gradients it sums: the k-th all-gather of
a pass is the k-th unit to become gathered in it, the k-th reduce-scatter of backward the
k-th unit to be freed there (FSDP2 frees a unit's parameters just before it reduce-scatters
its gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_guide.comm import payload_of

_COLLECTIVES = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}
# A look at the units between two events (autograd saving or using a tensor): it sees a unit
# gathered and freed again between two collectives, and is not an event of the timeline.
_SEEN = "seen"


@dataclass(frozen=True, kw_only=True)
class UnitEvent:
    """One event of a recorded step.

    Attributes:
        kind: ``"forward"`` (a unit's forward starts), ``"backward"`` (the backward pass
            starts), ``"all-gather"``, ``"reduce-scatter"`` or ``"end"``.
        unit: The unit it concerns (``"root"`` for the model itself); ``None`` for the
            phase marks.
        elements: Elements the collective gathered or reduce-scattered (0 for the marks).
        gathered: The units holding their full parameters at this event.
    """

    kind: str
    unit: str | None
    elements: int
    gathered: frozenset[str]


@dataclass(frozen=True)
class UnitTimeline:
    """The events of one FSDP2 step on one rank, with each collective's unit.

    Examples:
        >>> def event(kind, unit=None, gathered=()):
        ...     return UnitEvent(kind=kind, unit=unit, elements=0, gathered=frozenset(gathered))
        >>> t = UnitTimeline((
        ...     event("all-gather", "root"), event("forward", "root", ["root"]),
        ...     event("all-gather", "b0", ["root"]), event("forward", "b0", ["root", "b0"]),
        ...     event("backward", None, ["root"]), event("all-gather", "b0", ["root"]),
        ...     event("reduce-scatter", "b0", ["root"]), event("reduce-scatter", "root"),
        ...     event("end"),
        ... ))
        >>> t.held()
        {'b0': [(2, 4), (5, 6)], 'root': [(0, 7)]}
        >>> t.collectives("backward"), t.most_held("forward"), t.most_held("backward")
        (['all-gather b0', 'reduce-scatter b0', 'reduce-scatter root'], 2, 2)
    """

    events: tuple[UnitEvent, ...]

    @property
    def backward_start(self) -> int:
        """The index of the event that starts the backward pass."""
        return next(i for i, e in enumerate(self.events) if e.kind == "backward")

    def phase(self, name: str) -> range:
        """The event indices of ``"forward"`` or ``"backward"``."""
        if name not in ("forward", "backward"):
            raise ValueError(f"phase must be 'forward' or 'backward', not {name!r}")
        start = self.backward_start
        return range(0, start) if name == "forward" else range(start, len(self.events))

    def collectives(self, phase: str) -> list[str]:
        """``"all-gather blocks.0"``, ... in the order the rank issued them in ``phase``."""
        return [
            f"{e.kind} {e.unit}" for e in (self.events[i] for i in self.phase(phase))
            if e.kind in _COLLECTIVES.values()
        ]  # fmt: skip

    def held(self) -> dict[str, list[tuple[int, int]]]:
        """Per unit, the spans ``[start, end)`` of events during which its full parameters
        exist: from its all-gather until it is seen freed, or until its gradients are
        reduce-scattered."""
        spans: dict[str, list[tuple[int, int]]] = {}
        start: dict[str, int] = {}
        seen: set[str] = set()
        for i, event in enumerate(self.events):
            if event.kind == "all-gather" and event.unit is not None:
                start[event.unit] = i
            for unit in list(start):
                if unit in event.gathered:
                    seen.add(unit)
                elif unit in seen or (event.kind == "reduce-scatter" and event.unit == unit):
                    spans.setdefault(unit, []).append((start.pop(unit), i))
                    seen.discard(unit)
        return spans

    def most_held(self, phase: str) -> int:
        """The most units holding their full parameters at once during ``phase``."""
        spans = [span for unit in self.held().values() for span in unit]
        return max(sum(a <= i < b for a, b in spans) for i in self.phase(phase))

    def plot(self, title: str = "") -> Any:
        """Each unit's row, shaded while it holds its full parameters, with its all-gathers
        (▼) and reduce-scatters (▲); forward left of the dashed line, backward right.

        Returns:
            The matplotlib ``Figure`` (matplotlib is imported here).
        """
        import matplotlib.pyplot as plt

        names = list(dict.fromkeys(e.unit for e in self.events if e.unit is not None))
        held = self.held()
        figure, ax = plt.subplots(figsize=(6.4, 4.2))
        for row, name in enumerate(names):
            bars = [(a, b - a) for a, b in held.get(name, [])]
            ax.broken_barh(bars, (row - 0.35, 0.7), color="#9ecae1",
                           label="full parameters held" if row == 0 else None)  # fmt: skip
        marks = {"all-gather": ("v", "#0072B2"), "reduce-scatter": ("^", "#D55E00")}
        for i, event in enumerate(self.events):
            if event.kind in marks and event.unit is not None:
                marker, color = marks[event.kind]
                first = event.kind not in ax.get_legend_handles_labels()[1]
                ax.scatter(i, names.index(event.unit), marker=marker, s=80, color=color,
                           zorder=3, label=event.kind if first else None)  # fmt: skip
        start = self.backward_start
        ax.axvline(start, color="black", linestyle="--")
        ax.text(start / 2, -0.8, "forward", ha="center", fontsize=11)
        ax.text((start + len(self.events)) / 2, -0.8, "backward", ha="center", fontsize=11)
        ax.set_yticks(range(len(names)), names, fontsize=11)
        ax.set_ylim(len(names) - 0.4, -1.2)
        ax.set_xlabel("events of one training step, in order", fontsize=11)
        ax.xaxis.get_major_locator().set_params(integer=True)  # type: ignore[call-arg]
        if title:
            ax.set_title(title, fontsize=12)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=2, fontsize=10.5,
                  frameon=False)  # fmt: skip
        figure.tight_layout()
        return figure


def _is_unit(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _units(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Each FSDP2 unit by name (``"root"`` for the model), with one parameter it manages."""
    found: dict[str, nn.Module] = {
        name or "root": module for name, module in model.named_modules() if _is_unit(module)
    }
    if not found:
        raise ValueError(
            "the model has no FSDP2 unit: shard it first, e.g. "
            "shard(model, policy=LayerPolicy(Block)), then record its step"
        )
    probes: dict[str, tuple[nn.Module, str]] = {}
    for name, unit in found.items():
        inner = {n for n, m in unit.named_modules() if n and _is_unit(m)}
        names = (p for p, _ in unit.named_parameters())
        own = next((p for p in names if not any(p.startswith(f"{n}.") for n in inner)), None)
        if own is not None:
            probes[name] = (unit, own)
    return probes


def _match(events: list[tuple[str, str | None, int, frozenset[str]]]) -> tuple[UnitEvent, ...]:
    """The events with each collective's unit, matched in order (see the module's text)."""
    phase, previous = "forward", frozenset[str]()
    became: dict[tuple[str, str], list[str]] = {}
    for kind, _, _, gathered in events:
        # What changed by the backward mark happened in forward (the last unit's free).
        became.setdefault((phase, "all-gather"), []).extend(sorted(gathered - previous))
        became.setdefault((phase, "reduce-scatter"), []).extend(sorted(previous - gathered))
        phase = "backward" if kind == "backward" else phase
        previous = gathered
    queues = {key: iter(units) for key, units in became.items()}
    phase, matched = "forward", []
    for kind, unit, elements, gathered in events:
        phase = "backward" if kind == "backward" else phase
        if kind == _SEEN:
            continue
        if kind in _COLLECTIVES.values():
            unit = next(queues.get((phase, kind), iter(())), None)
        matched.append(UnitEvent(kind=kind, unit=unit, elements=elements, gathered=gathered))
    return tuple(matched)


def record_units(
    model: nn.Module, forward: Callable[[], Any], backward: Callable[[Any], None]
) -> UnitTimeline:
    """Record when each FSDP2 unit of ``model`` holds its full parameters in one step.

    Call it on every rank (the step's collectives need them all). ``forward`` runs the
    forward pass and returns what ``backward`` takes (the loss).

    Args:
        model: A model sharded with FSDP2 (``fully_shard``, or ``shard(model, policy=...)``).
        forward: Runs the forward pass and returns the loss.
        backward: Runs the backward pass.

    Returns:
        The ``UnitTimeline`` of this rank.

    Raises:
        ValueError: For a model with no FSDP2 unit.

    Examples:
        A model must be sharded with FSDP2 first (lesson 04 records one step on each rank):

        >>> record_units(nn.Linear(2, 2), lambda: None, lambda loss: None)
        Traceback (most recent call last):
        ...
        ValueError: the model has no FSDP2 unit: shard it first, ...
    """
    from torch.autograd.graph import saved_tensors_hooks
    from torch.distributed.tensor import DTensor

    probes = _units(model)
    events: list[tuple[str, str | None, int, frozenset[str]]] = []

    def note(kind: str, unit: str | None = None, elements: int = 0) -> None:
        gathered = frozenset(
            name
            for name, (module, parameter) in probes.items()
            if not isinstance(module.get_parameter(parameter), DTensor)
        )
        if kind != _SEEN or not events or events[-1][3] != gathered:
            events.append((kind, unit, elements, gathered))

    def look(tensor: Any) -> Any:
        note(_SEEN)
        return tensor

    class Collectives(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            result = func(*args, **(kwargs or {}))
            found = payload_of(func, args)
            if found is not None and found[0] in _COLLECTIVES:
                note(_COLLECTIVES[found[0]], elements=found[1])
            return result

    hooks = [
        module.register_forward_pre_hook(lambda *_, name=name: note("forward", name))
        for name, (module, _) in probes.items()
    ]
    try:
        with Collectives(), saved_tensors_hooks(look, look):  # type: ignore[no-untyped-call]
            loss = forward()
            note("backward")
            backward(loss)
        note("end")
    finally:
        for hook in hooks:
            hook.remove()
    return UnitTimeline(_match(events))
