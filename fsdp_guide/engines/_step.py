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
    """

    params: int
    grads: int
    largest_unit: int
    largest_unit_grads: int
    root_unit: int
    activations: int
    calls: ModuleCalls | None = None
    blocks: int | None = None


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
