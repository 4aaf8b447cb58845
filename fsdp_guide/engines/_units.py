"""Engines that shard a model unit by unit (FSDP): what wrap policies and describe ask (private).

FairScale FSDP, PyTorch FSDP1 and FSDP2 cut a model into *units* whose parameters are
gathered and freed together. :func:`fsdp_guide.wrap.shard`, manual wrapping
(:func:`fsdp_guide.wrap.wrapping`) and :func:`fsdp_guide.wrap.describe` are the same for all
three; what differs (the wrapper's class, its defaults, how a wrap policy is handed to it,
how to look inside a unit) is answered by the engine through :class:`UnitEngine`.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from torch import nn

from fsdp_guide.engines._base import Engine
from fsdp_guide.engines._shape import ModelShape
from fsdp_guide.engines._step import module_calls


class UnitPolicy(Protocol):
    """What an engine needs of a wrap policy (:class:`fsdp_guide.wrap.WrapPolicy` has it)."""

    def for_torch(self) -> Callable[..., bool]:
        """FSDP1's ``auto_wrap_policy`` callable."""

    def for_fairscale(self) -> Callable[..., bool]:
        """FairScale's ``auto_wrap_policy`` callable."""

    def select(self, model: nn.Module) -> list[str]:
        """Qualified names of the modules that become units besides the root, children first."""


@dataclass(frozen=True, kw_only=True)
class UnitView:
    """What is inside one unit.

    Attributes:
        inner: The wrapped module (the unit itself when the engine shards in place).
        params: Parameter elements the unit manages, unsharded, when the engine records it;
            ``None`` when they are counted from the module (FSDP2).
    """

    inner: nn.Module
    params: int | None


@dataclass(frozen=True)
class UnitEngine(Engine):
    """An :class:`~fsdp_guide.engines.Engine` that shards unit by unit (FSDP)."""

    #: Whether :meth:`shard` changes the model in place and returns it (FSDP2) rather than
    #: returning a new wrapper: an optimizer built before then holds replaced parameters.
    shards_in_place: ClassVar[bool] = False

    def check_available(self) -> None:
        """Raise :class:`~fsdp_guide.errors.EngineUnavailableError` if it cannot run here."""

    @abstractmethod
    def unit_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` with this rank's defaults filled in (its device, a device mesh)."""

    @abstractmethod
    def shard(
        self, module: nn.Module, policy: UnitPolicy | None, options: dict[str, Any]
    ) -> nn.Module:
        """Make the modules ``policy`` selects units, then the root (``options`` filled in)."""

    def wrapping_context(self, options: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
        """The library's own ``enable_wrap`` context, if it has one."""
        return contextlib.nullcontext()

    @abstractmethod
    def wrap_unit(
        self, module: nn.Module, options: dict[str, Any], overrides: dict[str, Any]
    ) -> nn.Module:
        """Make ``module`` one unit inside :meth:`wrapping_context` entered with ``options``.

        Args:
            module: The module.
            options: The block's options, filled in by :meth:`unit_options`.
            overrides: Options for this unit only, over the block's.
        """

    @classmethod
    @abstractmethod
    def unit(cls, module: nn.Module) -> UnitView | None:
        """What ``module`` wraps, if it is a unit of this engine; else ``None``."""


#: How a model is cut into units: a unit per transformer block (:func:`block_classes`), or
#: the whole model one unit.
UnitRule = Literal["blocks", "root"]
UNIT_RULES: tuple[str, ...] = ("blocks", "root")


def block_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The classes of ``model``'s transformer blocks: the modules that each become a unit.

    What users wrap: the classes transformers lists in a model's ``_no_split_modules`` (what
    its authors say must stay in one piece, and what accelerate and the ``Trainer`` wrap),
    else the class of the children of each outermost ``ModuleList`` whose children all share
    one class (the ``layers``/``blocks``/``h`` list of a model written by hand). Empty when
    neither is there: the model is then one unit.

    Examples:
        >>> from fsdp_guide.models import MLP, TinyTransformer, TransformerConfig
        >>> block_classes(TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2)))
        (<class 'fsdp_guide.models.Block'>,)
        >>> block_classes(MLP())
        ()
    """
    names: set[str] = set()
    for module in model.modules():
        declared = getattr(module, "_no_split_modules", None)
        if isinstance(declared, list | tuple | set):
            names.update(str(name) for name in declared)
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if found:
        return tuple(sorted(found, key=lambda cls: cls.__name__))
    repeated: dict[type[nn.Module], None] = {}

    def visit(module: nn.Module) -> None:
        for child in module.children():
            kinds = {type(c) for c in child.children()} if isinstance(child, nn.ModuleList) else ()
            if len(kinds) == 1:
                repeated.setdefault(next(iter(kinds)))
            else:
                visit(child)

    visit(model)
    return tuple(repeated)


def unit_names(model: nn.Module, rule: UnitRule | UnitPolicy = "blocks") -> list[str]:
    """Qualified names of the modules ``rule`` makes units besides the root, children first.

    Args:
        model: The unwrapped model.
        rule: ``"blocks"`` (:func:`block_classes`), ``"root"`` (none: the whole model one
            unit), or a policy with a ``select(model)`` method (a
            :class:`fsdp_guide.wrap.WrapPolicy`).

    Raises:
        ValueError: For another rule.

    Examples:
        >>> from fsdp_guide.models import TinyTransformer, TransformerConfig
        >>> model = TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2))
        >>> unit_names(model), unit_names(model, "root")
        (['blocks.0', 'blocks.1'], [])
    """
    if not isinstance(rule, str):
        if not callable(getattr(rule, "select", None)):
            raise ValueError(
                f"a wrap policy must be 'blocks', 'root' or a WrapPolicy, got {rule!r}"
            )
        return list(rule.select(model))
    if rule not in UNIT_RULES:
        raise ValueError(f"unknown wrap rule {rule!r}; choose 'blocks', 'root' or a WrapPolicy")
    classes = block_classes(model) if rule == "blocks" else ()
    names: list[str] = []
    # How many modules use each parameter: a block sharing one with a module outside it
    # (tied embeddings) stays in its parent's unit, as FSDP needs a shared parameter in one.
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1

    def shared_outside(module: nn.Module) -> bool:
        inside: dict[int, int] = {}
        for sub in module.modules():
            for p in sub.parameters(recurse=False):
                inside[id(p)] = inside.get(id(p), 0) + 1
        return any(users[key] > count for key, count in inside.items())

    def visit(module: nn.Module, name: str) -> None:
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)
        if name and classes and isinstance(module, classes) and not shared_outside(module):
            names.append(name)

    visit(model, "")
    return names


def unit_modules(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules of the unit ``name``: one, or several joined by ``+`` (``"embed+head"``,
    one unit of both, as ``fully_shard([embed, head])`` makes: how tied weights share one).

    Examples:
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> [type(m).__name__ for m in unit_modules(model, "0+2")]
        ['Linear', 'Linear']
    """
    return [model.get_submodule(part) for part in name.split("+")]


def unit_shapes(
    model: nn.Module, names: Sequence[str], *, trainable_only: bool = False
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The shapes of each unit's own parameters, the root first, then ``names`` in order.

    A parameter belongs to the innermost unit that holds it (``names`` lists children before
    parents); a parameter shared by two modules (tied embeddings) is counted once, where
    ``model.parameters()`` first meets it. ``trainable_only`` keeps the parameters that
    require a gradient (what has gradients and optimizer state).

    Examples:
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
        >>> unit_shapes(model, ["1"])
        (((3, 2), (3,)), ((1, 3), (1,)))
    """
    owner: dict[int, int] = {}
    for index, name in enumerate(names, start=1):
        for module in unit_modules(model, name):
            for p in module.parameters():
                owner.setdefault(id(p), index)
    units: list[list[tuple[int, ...]]] = [[] for _ in range(len(names) + 1)]
    for p in model.parameters():
        if p.requires_grad or not trainable_only:
            units[owner.get(id(p), 0)].append(tuple(p.shape))
    return tuple(tuple(unit) for unit in units)


def model_shape(
    model: nn.Module, rule: UnitRule | UnitPolicy = "blocks", *, trainable_only: bool = False
) -> ModelShape:
    """The shape of ``model`` cut into units by ``rule``: what the predictions are computed from.

    Its ``units`` are the shape of each parameter of each unit, the root unit first (a
    shared parameter is in one unit only); ``buffers`` the elements of the model's buffers,
    which DDP broadcasts before every forward; ``num_params``, ``root_params`` and
    ``shapes`` follow from them. With ``trainable_only``, only the parameters that
    train (``requires_grad``): those that have gradients and optimizer state.

    Examples:
        >>> from fsdp_guide.models import TinyTransformer, TransformerConfig
        >>> shape = model_shape(TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2)))
        >>> len(shape.units), shape.root_params, shape.buffers
        (3, 17472, 0)
    """
    units = unit_shapes(model, unit_names(model, rule), trainable_only=trainable_only)
    return ModelShape(
        units=units, buffers=sum(b.numel() for b in model.buffers()), calls=module_calls(model)
    )


def follows_units(engine: Engine) -> bool:
    """Whether a plan of ``engine`` depends on how the model is cut into units.

    The FSDP engines (every :class:`UnitEngine`, their variants that do not shard parameters
    included: FSDP1 pads a flat parameter per unit) and any other engine that gathers
    parameters in the step (DeepSpeed ZeRO-3, whose largest gathered piece is planned as the
    largest unit).

    Examples:
        >>> from fsdp_guide.engines import engine_for
        >>> [follows_units(engine_for(s)) for s in ("ddp", "fsdp_no_shard", "fsdp2")]
        [False, True, True]
    """
    return isinstance(engine, UnitEngine) or engine.stage_at_step >= 3


def unit_summary(model: nn.Module, names: Sequence[str], rule: UnitRule | UnitPolicy) -> str:
    """The units ``rule`` makes of ``model`` in words: their classes and counts, and the root.

    Args:
        model: The unwrapped model.
        names: The units besides the root, as :func:`unit_names` gives them for ``rule``.
        rule: ``"blocks"``, ``"root"`` or the wrap policy that chose ``names``.

    Examples:
        >>> from fsdp_guide.models import TinyTransformer, TransformerConfig
        >>> from fsdp_guide.wrap import SizePolicy
        >>> model = TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2))
        >>> unit_summary(model, unit_names(model), "blocks")
        'a unit per Block (2) + the root'
        >>> unit_summary(model, [], "root")
        'the whole model (root)'
        >>> policy = SizePolicy(min_num_params=5_000)
        >>> unit_summary(model, unit_names(model, policy), policy)
        'a unit per module of >= 5,000 parameters not in a smaller unit: Embedding (1), Block ...'
    """
    if not names:
        if rule == "root":
            return "the whole model (root)"
        if rule == "blocks":
            return "the whole model (root): no transformer block found"
        return f"the whole model (root): {rule!r} selects no module"
    counts: dict[str, int] = {}
    for name in names:
        kind = "+".join(type(m).__name__ for m in unit_modules(model, name))
        counts[kind] = counts.get(kind, 0) + 1
    classes = ", ".join(f"{kind} ({n})" for kind, n in counts.items())
    # Read by attribute: the wrap package's policies are built on this one (it imports engines).
    if rule == "blocks" or hasattr(rule, "layer_classes"):
        return f"a unit per {classes} + the root"
    smallest = getattr(rule, "min_num_params", None)
    if isinstance(smallest, int):
        return (
            f"a unit per module of >= {smallest:,} parameters not in a smaller "
            f"unit: {classes} + the root"
        )
    return f"{rule!r}: {classes} + the root"
