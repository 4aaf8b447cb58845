"""Show how a model is cut into FSDP units: :func:`describe` and :func:`sharded_units`.

Wrappers are looked through: FSDP1's ``_fsdp_wrapped_module``, FairScale's
``_fsdp_wrapped_module._fpw_module`` and PyTorch's ``_checkpoint_wrapped_module`` do not
appear in names, so ``blocks.0`` is ``blocks.0`` before and after wrapping. A unit's
parameter count is the number of parameter elements it manages (unsharded), read from the
engine's own bookkeeping: FSDP1's flat parameter, FairScale's original sizes, FSDP2's
DTensors (whose ``numel`` is the global one).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from torch import nn

from fsdp_guide.engines import unit_of
from fsdp_guide.wrap._policy import WrapPolicy, selected_modules


@dataclass(frozen=True)
class ModuleNode:
    """One module of the tree as :func:`describe` shows it.

    Attributes:
        name: Qualified name with wrapper attributes removed (``""`` for the root).
        depth: Nesting depth (root is 0).
        class_name: Class of the wrapped (original) module.
        engine: ``"fsdp1"``, ``"fsdp2"``, ``"fairscale_fsdp"``, ``"planned"`` (from a policy)
            or ``None`` when the module is not a unit.
        unit_params: Parameter elements the unit manages; ``None`` when not a unit.
        checkpointed: Whether activation checkpointing wraps the module.
    """

    name: str
    depth: int
    class_name: str
    engine: str | None
    unit_params: int | None
    checkpointed: bool


def is_checkpointed(module: nn.Module) -> bool:
    """Whether activation checkpointing (PyTorch's or FairScale's) wraps ``module``.

    Examples:
        >>> is_checkpointed(nn.Linear(2, 2))
        False
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    if isinstance(module, CheckpointWrapper):
        return True
    # FairScale's checkpoint_wrapper keeps the module and patches its forward.
    forward = module.__dict__.get("forward")
    return (
        isinstance(forward, functools.partial)
        and getattr(forward.func, "__name__", "") == "_checkpointed_forward"
    )


def _unwrap(module: nn.Module) -> tuple[nn.Module, str | None, int | None, bool]:
    """Look through wrappers: (original module, engine, unit params, checkpointed)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    engine: str | None = None
    unit_params: int | None = None
    checkpointed = False
    while True:
        if is_checkpointed(module):
            checkpointed = True
        found = unit_of(module)
        if found is not None:
            engine, view = found
            if view.inner is not module:
                unit_params, module = view.params, view.inner
                continue
        # Sharded in place (FSDP2), or no unit: look through a checkpoint wrapper only.
        if isinstance(module, CheckpointWrapper):
            module = module._checkpoint_wrapped_module
        else:
            return module, engine, unit_params, checkpointed


def _class_name(module: nn.Module) -> str:
    from torch.distributed.fsdp import FSDPModule

    for cls in type(module).__mro__:  # FSDP2 makes a subclass named FSDP<Class>
        if not issubclass(cls, FSDPModule):
            return cls.__name__
    return type(module).__name__


def module_tree(module: nn.Module, policy: WrapPolicy | None = None) -> list[ModuleNode]:
    """The modules of ``module`` in order, wrappers looked through, units marked.

    Args:
        module: A model, wrapped or not.
        policy: If given, mark the units this policy would make (engine ``"planned"``) on an
            unwrapped model, the root included.

    Examples:
        >>> [node.name for node in module_tree(nn.Sequential(nn.Linear(2, 2)))]
        ['', '0']
    """
    planned: dict[int, str] = {}
    if policy is not None:
        planned = {id(m): name for name, m in selected_modules(module, policy)}
        planned[id(module)] = ""
    nodes: list[ModuleNode] = []

    def visit(wrapped: nn.Module, name: str, depth: int) -> int:
        inner, engine, unit_params, checkpointed = _unwrap(wrapped)
        index = len(nodes)
        node = ModuleNode(
            name=name,
            depth=depth,
            class_name=_class_name(inner),
            engine=engine,
            unit_params=None,
            checkpointed=checkpointed,
        )
        nodes.append(node)
        nested = 0  # parameter elements taken by units below this one
        for child_name, child in inner.named_children():
            nested += visit(child, f"{name}.{child_name}" if name else child_name, depth + 1)
        # A policy selects the module inside a checkpoint wrapper, as FSDP's walk does.
        if engine is None and (id(wrapped) in planned or id(inner) in planned):
            engine = "planned"
        if engine is not None and unit_params is None:
            # Counted from the module: a planned unit, or an engine that records no count of
            # its own (FSDP2's DTensors have the global numel).
            unit_params = sum(p.numel() for p in inner.parameters()) - nested
        if engine is not None:
            nodes[index] = replace(node, engine=engine, unit_params=unit_params)
            return nested + (unit_params or 0)
        return nested

    visit(module, "", 0)
    return nodes


def sharded_units(
    module: nn.Module, policy: WrapPolicy | None = None
) -> dict[str, tuple[str, int]]:
    """Each unit's qualified name mapped to ``(engine, parameter elements it manages)``.

    Examples:
        >>> from fsdp_guide.wrap import LayerPolicy
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> sharded_units(model, policy=LayerPolicy(nn.Linear))
        {'': ('planned', 0), '0': ('planned', 20), '2': ('planned', 10)}
    """
    return {
        node.name: (node.engine, node.unit_params or 0)
        for node in module_tree(module, policy)
        if node.engine is not None
    }


def describe(
    module: nn.Module, policy: WrapPolicy | None = None, max_depth: int | None = None
) -> str:
    """An indented tree of ``module`` marking FSDP units, their engine and size, and checkpointing.

    Args:
        module: A model, wrapped or not.
        policy: On an unwrapped model, show the units this policy would make.
        max_depth: Hide modules nested deeper than this (the root is depth 0).

    Returns:
        One line per module, ``name: Class``, then ``[unit: engine, N params]`` for units and
        ``[checkpointed]`` for checkpointed modules.

    Examples:
        >>> from fsdp_guide.wrap import SizePolicy
        >>> model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 2))
        >>> print(describe(model, policy=SizePolicy(min_num_params=1000)))
        (root): Sequential  [unit: planned, 202 params]
          0: Linear  [unit: planned, 10,100 params]
          1: ReLU
          2: Linear
    """
    lines = []
    for node in module_tree(module, policy):
        if max_depth is not None and node.depth > max_depth:
            continue
        label = node.name.rsplit(".", 1)[-1] if node.name else "(root)"
        line = f"{'  ' * node.depth}{label}: {node.class_name}"
        if node.engine is not None:
            line += f"  [unit: {node.engine}, {node.unit_params or 0:,} params]"
        if node.checkpointed:
            line += "  [checkpointed]"
        lines.append(line)
    return "\n".join(lines)
