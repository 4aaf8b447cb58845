"""Records of what a step's peak depends on, and of what is held then (private)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, kw_only=True)
class ModuleCalls:
    """A model's modules as its forward enters and leaves them, each with its own parameters.

    Each module is taken to run once, its children in the order they were registered (what
    a transformer's forward does); a parameter shared by two modules (tied embeddings) is
    one entry of ``numels`` named by both.

    Attributes:
        numels: Elements of each distinct parameter, in ``model.parameters()`` order.
        modules: Each module's own parameters (not its children's), as indices into
            ``numels``; the root module first.
        events: ``(module, entering)``, in the order forward enters and leaves them.

    Examples:
        >>> calls = module_calls(nn.Sequential(nn.Linear(2, 3), nn.ReLU()))
        >>> calls.numels, calls.modules
        ((6, 3), ((), (0, 1), ()))
        >>> calls.events
        ((0, True), (1, True), (1, False), (2, True), (2, False), (0, False))
    """

    numels: tuple[int, ...]
    modules: tuple[tuple[int, ...], ...]
    events: tuple[tuple[int, bool], ...]

    @property
    def num_params(self) -> int:
        """``Ψ``: the elements of every distinct parameter."""
        return sum(self.numels)


def module_calls(model: nn.Module) -> ModuleCalls:
    """The :class:`ModuleCalls` of ``model`` (a model on the meta device will do)."""
    index: dict[int, int] = {}
    numels: list[int] = []
    modules: list[tuple[int, ...]] = []
    events: list[tuple[int, bool]] = []

    def visit(module: nn.Module) -> None:
        own = []
        for param in module.parameters(recurse=False):
            if id(param) not in index:
                index[id(param)] = len(numels)
                numels.append(param.numel())
            own.append(index[id(param)])
        number = len(modules)
        modules.append(tuple(own))
        events.append((number, True))
        for child in module.children():
            visit(child)
        events.append((number, False))

    visit(model)
    return ModuleCalls(numels=tuple(numels), modules=tuple(modules), events=tuple(events))


@dataclass(frozen=True, kw_only=True)
class Stretch:
    """A stretch of backward as one process runs it, traced on fake tensors: the loss and the
    layers after the last unit, one unit's backward, or the layers before the first unit.

    Attributes:
        unit: Whether it is a unit's backward.
        start: Activation bytes held as it starts.
        peak: The most activation bytes held during it: those saved and not yet freed, the
            gradients flowing back, a checkpointed unit's forward run again.
        grads: Bytes of the parameter gradients it produces, at the gradients' precision.
        largest_grad: Bytes of the largest of them.

    Examples:
        >>> Stretch(unit=True, start=10, peak=25, grads=8, largest_grad=6).peak
        25
    """

    unit: bool
    start: int
    peak: int
    grads: int
    largest_grad: int


@dataclass(frozen=True, kw_only=True)
class StepSizes:
    """The sizes a step's peak depends on, in bytes (what :meth:`Engine.step_peak` reads).

    Attributes:
        params: All parameters at the parameters' precision (``P · Ψ``).
        grads: All gradients at the gradients' precision (``G · Ψ``).
        largest_unit: Parameters of the largest unit (a block), at ``P``.
        largest_unit_grads: Its gradients, at ``G``.
        root_unit: Parameters of the root unit (outside the blocks), at ``P``.
        activations: What autograd saves in this rank's forward.
        calls: The modules forward runs, with their parameters, where an engine's answer
            depends on their order (DeepSpeed ZeRO-3); ``None`` where not known.
        blocks: How many units there are besides the root; ``None`` when not counted.
        forward: Forward and the loss in :class:`Stretch` es, cut where a unit starts and
            ends (what is saved so far and the running layer's temporaries); empty where
            not traced.
        stretches: Backward in :class:`Stretch` es, in the order it runs them (the
            activations' peak in backward is the largest of their peaks); empty where not
            traced.
        step_grads: Gradient bytes the optimizer step reads beyond the state kept between
            steps (what ``zero_grad()`` frees after it).
        optimizer_temporaries: Bytes the optimizer allocates while it steps (Adam's
            ``sqrt`` of its second moment and the quotient: twice the largest tensor it
            steps one tensor at a time, once every tensor with ``foreach``).
    """

    params: int
    grads: int
    largest_unit: int
    largest_unit_grads: int
    root_unit: int
    activations: int
    calls: ModuleCalls | None = None
    blocks: int | None = None
    forward: tuple[Stretch, ...] = ()
    stretches: tuple[Stretch, ...] = ()
    step_grads: int = 0
    optimizer_temporaries: int = 0

    @property
    def units_backward(self) -> tuple[Stretch, ...]:
        """The units' stretches of backward, the last unit first."""
        return tuple(s for s in self.stretches if s.unit)

    @property
    def head_grads(self) -> int:
        """Gradient bytes backward produces before its first unit (the head's, the root's)."""
        first = next((i for i, s in enumerate(self.stretches) if s.unit), len(self.stretches))
        return sum(s.grads for s in self.stretches[:first])

    def piled(self) -> StepPeak:
        """Backward as one process runs it, its gradients kept as they come: in each
        stretch, its activations, the gradients of the stretches before it and one fresh
        gradient of its own.

        Examples:
            >>> sizes = StepSizes(params=4, grads=4, largest_unit=1, largest_unit_grads=1,
            ...                   root_unit=0, activations=10, stretches=(
            ...     Stretch(unit=False, start=10, peak=12, grads=3, largest_grad=3),
            ...     Stretch(unit=True, start=8, peak=9, grads=5, largest_grad=4)))
            >>> sizes.piled().bytes  # 9 + 3 + 4
            16
        """
        done = best = 0
        for stretch in self.stretches:
            best = max(best, stretch.peak + done + stretch.largest_grad)
            done += stretch.grads
        return StepPeak(bytes=best, phase="backward", kind="activations + the gradients so far")

    def optimizer_step(self, extra: int = 0, kind: str = "") -> StepPeak:
        """The optimizer step: the gradients it reads, its temporaries and ``extra``."""
        what = "gradients + the optimizer's temporaries" + (f" + {kind}" if kind else "")
        return StepPeak(
            bytes=self.step_grads + self.optimizer_temporaries + extra,
            phase="optimizer step",
            kind=what,
        )

    @property
    def forward_peak(self) -> int:
        """The most activation bytes forward holds at once: :attr:`activations` when not
        traced."""
        return max((s.peak for s in self.forward), default=self.activations)

    @property
    def backward_activations(self) -> int:
        """The most activation bytes backward holds at once: :attr:`activations` when not
        traced.

        Examples:
            >>> sizes = StepSizes(params=4, grads=4, largest_unit=1, largest_unit_grads=1,
            ...                   root_unit=0, activations=10)
            >>> sizes.backward_activations
            10
        """
        return max((s.peak for s in self.stretches), default=self.activations)


@dataclass(frozen=True, kw_only=True)
class StepPeak:
    """What a rank holds at the peak of a training step beyond the state kept between steps.

    Attributes:
        bytes: Activations and short-lived buffers at the peak.
        phase: ``"forward"``, ``"backward"`` or ``"optimizer step"``.
        kind: What makes it up, in words.

    Examples:
        >>> StepPeak(bytes=10, phase="backward", kind="activations + gradients").bytes
        10
    """

    bytes: int
    phase: str
    kind: str


def highest(*moments: StepPeak | None) -> StepPeak:
    """The moment that holds the most (the first of equal ones).

    Examples:
        >>> a = StepPeak(bytes=5, phase="forward", kind="a")
        >>> highest(a, None, StepPeak(bytes=7, phase="backward", kind="b")).phase
        'backward'
    """
    found = [m for m in moments if m is not None]
    return max(found, key=lambda m: m.bytes)


@dataclass(frozen=True, kw_only=True)
class Gathered:
    """Whole parameters an engine holds beyond its shards in a step, in bytes.

    Attributes:
        after_forward: Left gathered when forward returns (alive with every activation).
        peak: Gathered at the step's peak, as backward starts (``after_forward`` and what
            backward's first modules gather and prefetch).
        kind: What decides them, in words.

    Examples:
        >>> Gathered(after_forward=8, peak=12, kind="kept for reuse").peak
        12
    """

    after_forward: int
    peak: int
    kind: str
