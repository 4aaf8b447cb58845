"""Wrap policies: which modules of a model become their own FSDP unit.

A policy answers two questions while a model is walked from the root down, the way
FairScale's ``auto_wrap`` and PyTorch FSDP1's ``auto_wrap_policy`` walk it: *recurse*
into this module's children? and, after its children were handled, *wrap* this module,
given the number of its parameters no child unit took (``nonwrapped_numel``)?

One policy object serves every engine:

* :meth:`WrapPolicy.for_torch` is an ``auto_wrap_policy`` for
  :class:`torch.distributed.fsdp.FullyShardedDataParallel` (FSDP1),
* :meth:`WrapPolicy.for_fairscale` is an ``auto_wrap_policy`` for FairScale's
  :func:`~fairscale.nn.wrap.auto_wrap` / ``enable_wrap``,
* :meth:`WrapPolicy.select` lists the modules to pass to FSDP2's ``fully_shard``, children
  before parents; it runs the same walk the two libraries run, so it also predicts exactly
  which units FSDP1 and FairScale make. The root is never in the list: every engine makes
  the root a unit of its own, holding whatever parameters are left.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

PolicyCallable = Callable[..., bool]


class WrapPolicy(ABC):
    """A rule that picks the modules of a model that become FSDP units.

    Subclasses decide :meth:`should_recurse` and :meth:`should_wrap`; ``a | b`` is the union
    (``AnyOf``).
    """

    @abstractmethod
    def should_recurse(self, module: nn.Module, nonwrapped_numel: int) -> bool:
        """Whether to look for units among ``module``'s children.

        Args:
            module: The module being visited.
            nonwrapped_numel: Parameter elements in ``module``'s whole subtree.
        """

    @abstractmethod
    def should_wrap(self, module: nn.Module, nonwrapped_numel: int) -> bool:
        """Whether ``module`` becomes a unit once its children were handled.

        Args:
            module: The module being visited.
            nonwrapped_numel: Parameter elements of its subtree not taken by a child unit.
        """

    def decide(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        """The answer to one question of the walk, as an auto-wrap callable gives it.

        Examples:
            >>> SizePolicy(10).decide(nn.Linear(2, 2), recurse=False, nonwrapped_numel=6)
            False
        """
        if recurse:
            return self.should_recurse(module, nonwrapped_numel)
        return self.should_wrap(module, nonwrapped_numel)

    def for_torch(self) -> PolicyCallable:
        """This policy as FSDP1's ``auto_wrap_policy`` callable.

        FSDP1 calls it as ``policy(module=, recurse=, nonwrapped_numel=)`` and wraps the root
        itself afterwards.

        Examples:
            >>> policy = LayerPolicy(nn.Linear).for_torch()
            >>> policy(module=nn.Linear(2, 2), recurse=False, nonwrapped_numel=6)
            True
        """

        def torch_auto_wrap_policy(
            module: nn.Module, recurse: bool, nonwrapped_numel: int, **_: Any
        ) -> bool:
            return self.decide(module, recurse, nonwrapped_numel)

        return torch_auto_wrap_policy

    def for_fairscale(self) -> PolicyCallable:
        """This policy as FairScale's ``auto_wrap_policy`` callable.

        FairScale calls it as ``policy(module=, recurse=, unwrapped_params=, module_is_root=)``.
        It never asks to wrap the root: :func:`fsdp_guide.wrap.shard` wraps the root last,
        as FSDP1 does, so the units are the same for both engines.

        Examples:
            >>> policy = LayerPolicy(nn.Linear).for_fairscale()
            >>> layer = nn.Linear(2, 2)
            >>> policy(module=layer, recurse=False, unwrapped_params=6, module_is_root=False)
            True
            >>> policy(module=layer, recurse=False, unwrapped_params=6, module_is_root=True)
            False
        """

        def fairscale_auto_wrap_policy(
            module: nn.Module,
            recurse: bool,
            unwrapped_params: int,
            module_is_root: bool = False,
            **_: Any,
        ) -> bool:
            if module_is_root and not recurse:
                return False
            return self.decide(module, recurse, unwrapped_params)

        return fairscale_auto_wrap_policy

    def select(self, model: nn.Module) -> list[str]:
        """Qualified names of the modules that become units besides the root, children first.

        Examples:
            >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
            >>> LayerPolicy(nn.Linear).select(model)
            ['0', '2']
        """
        return [name for name, _ in selected_modules(model, self)]

    def __or__(self, other: WrapPolicy) -> AnyOf:
        if not isinstance(other, WrapPolicy):
            return NotImplemented
        return AnyOf(self, other)


class SizePolicy(WrapPolicy):
    """Wrap a module once it holds at least ``min_num_params`` parameter elements not yet wrapped.

    Same rule as FairScale's ``default_auto_wrap_policy`` and PyTorch's
    ``size_based_auto_wrap_policy``: recurse into modules that are large enough (except the
    ``force_leaf`` types, whose children are never units), wrap large enough modules except the
    ``exclude`` types (containers such as :class:`~torch.nn.ModuleList`, which have no
    ``forward`` of their own).

    Args:
        min_num_params: Smallest number of not-yet-wrapped parameter elements of a unit.
        exclude: Module types never wrapped.
        force_leaf: Module types whose children are never wrapped.

    Raises:
        ValueError: If ``min_num_params`` is not a positive int.

    Examples:
        >>> from fsdp_guide.models import TinyTransformer, TransformerConfig
        >>> model = TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2))
        >>> SizePolicy(min_num_params=10_000).select(model)
        ['blocks.0', 'blocks.1']
        >>> SizePolicy(min_num_params=5_000).select(model)
        ['tok_emb', 'blocks.0', 'blocks.1', 'head']
        >>> SizePolicy(min_num_params=4_000).select(model)[1:4]  # fc layers first, then the rest
        ['blocks.0.fc1', 'blocks.0.fc2', 'blocks.0']
    """

    def __init__(
        self,
        min_num_params: int,
        exclude: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.ModuleDict),
        force_leaf: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,),
    ) -> None:
        if isinstance(min_num_params, bool) or not isinstance(min_num_params, int):
            raise ValueError(
                f"min_num_params must be a positive int, got {min_num_params!r}; "
                "write e.g. SizePolicy(min_num_params=100_000)"
            )
        if min_num_params < 1:
            raise ValueError(f"min_num_params must be >= 1, got {min_num_params}")
        self.min_num_params = min_num_params
        self.exclude = tuple(exclude)
        self.force_leaf = tuple(force_leaf)

    def should_recurse(self, module: nn.Module, nonwrapped_numel: int) -> bool:
        return nonwrapped_numel >= self.min_num_params and not isinstance(module, self.force_leaf)

    def should_wrap(self, module: nn.Module, nonwrapped_numel: int) -> bool:
        return nonwrapped_numel >= self.min_num_params and not isinstance(module, self.exclude)

    def __repr__(self) -> str:
        return f"SizePolicy(min_num_params={self.min_num_params})"


def check_layer_classes(
    classes: Iterable[object], what: str = "LayerPolicy", example: str = "LayerPolicy(Block)"
) -> tuple[type[nn.Module], ...]:
    """``classes`` as a tuple for ``isinstance``, each checked to be an ``nn.Module`` subclass.

    Args:
        classes: The layer classes given.
        what: The argument's name in the error message.
        example: A correct use, shown in the error message.

    Raises:
        TypeError: For an item that is not an ``nn.Module`` subclass (an instance, a name).

    Examples:
        >>> check_layer_classes([nn.Linear, nn.ReLU])
        (<class 'torch.nn.modules.linear.Linear'>, <class 'torch.nn.modules.activation.ReLU'>)
        >>> check_layer_classes(["Linear"])
        Traceback (most recent call last):
        ...
        TypeError: LayerPolicy takes nn.Module subclasses, got 'Linear'; pass the class itself ...
    """
    checked: list[type[nn.Module]] = []
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(
                f"{what} takes nn.Module subclasses, got {cls!r}; pass the class "
                f"itself ({example}), not an instance or a name"
            )
        checked.append(cls)
    return tuple(checked)


class LayerPolicy(WrapPolicy):
    """Wrap every module that is an instance of one of ``layer_classes``, whatever its size.

    The rule of PyTorch's ``ModuleWrapPolicy`` / ``transformer_auto_wrap_policy``: always
    recurse, wrap instances of the given classes. Wrapping each transformer block on its own
    is the usual choice: a block's weights are gathered just before it runs and freed after.

    Args:
        *layer_classes: One or more :class:`~torch.nn.Module` subclasses.

    Raises:
        TypeError: If no class is given or one is not a Module subclass.

    Examples:
        >>> from fsdp_guide.models import Block, TinyTransformer, TransformerConfig
        >>> model = TinyTransformer(TransformerConfig(n_layers=3, dim=32, n_heads=2))
        >>> LayerPolicy(Block).select(model)
        ['blocks.0', 'blocks.1', 'blocks.2']
        >>> LayerPolicy(Block, nn.Embedding).select(model)
        ['tok_emb', 'pos_emb', 'blocks.0', 'blocks.1', 'blocks.2']
    """

    def __init__(self, *layer_classes: type[nn.Module]) -> None:
        if len(layer_classes) == 1 and isinstance(layer_classes[0], tuple | list | set):
            layer_classes = tuple(layer_classes[0])
        if not layer_classes:
            raise TypeError("LayerPolicy needs at least one layer class, e.g. LayerPolicy(Block)")
        self.layer_classes = check_layer_classes(layer_classes)

    def should_recurse(self, module: nn.Module, nonwrapped_numel: int) -> bool:
        return True

    def should_wrap(self, module: nn.Module, nonwrapped_numel: int) -> bool:
        return isinstance(module, self.layer_classes)

    def __repr__(self) -> str:
        return f"LayerPolicy({', '.join(cls.__name__ for cls in self.layer_classes)})"


class AnyOf(WrapPolicy):
    """The union of policies: recurse or wrap when any of them says so (PyTorch's ``_or_policy``).

    Args:
        *policies: Two or more policies; ``a | b`` builds the same thing.

    Raises:
        TypeError: If an argument is not a :class:`WrapPolicy`, or none is given.

    Examples:
        >>> from fsdp_guide.models import Block, TinyTransformer, TransformerConfig
        >>> model = TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2))
        >>> policy = LayerPolicy(Block) | SizePolicy(min_num_params=8_000)
        >>> policy
        AnyOf(LayerPolicy(Block), SizePolicy(min_num_params=8000))
        >>> policy.select(model)
        ['tok_emb', 'blocks.0', 'blocks.1', 'head']
    """

    def __init__(self, *policies: WrapPolicy) -> None:
        if not policies:
            raise TypeError("AnyOf needs at least one policy, e.g. AnyOf(LayerPolicy(Block))")
        flat: list[WrapPolicy] = []
        for policy in policies:
            if not isinstance(policy, WrapPolicy):
                raise TypeError(
                    f"AnyOf combines WrapPolicy objects, got {policy!r}; wrap classes in "
                    "LayerPolicy(...) and sizes in SizePolicy(...)"
                )
            flat.extend(policy.policies if isinstance(policy, AnyOf) else [policy])
        self.policies: tuple[WrapPolicy, ...] = tuple(flat)

    def should_recurse(self, module: nn.Module, nonwrapped_numel: int) -> bool:
        return any(p.should_recurse(module, nonwrapped_numel) for p in self.policies)

    def should_wrap(self, module: nn.Module, nonwrapped_numel: int) -> bool:
        return any(p.should_wrap(module, nonwrapped_numel) for p in self.policies)

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(repr(p) for p in self.policies)})"


def any_of(*policies: WrapPolicy) -> AnyOf:
    """The union of ``policies`` (same as ``policies[0] | policies[1] | ...``).

    Examples:
        >>> any_of(SizePolicy(1000), LayerPolicy(nn.Linear))
        AnyOf(SizePolicy(min_num_params=1000), LayerPolicy(Linear))
    """
    return AnyOf(*policies)


def selected_modules(model: nn.Module, policy: WrapPolicy) -> list[tuple[str, nn.Module]]:
    """The ``(qualified name, module)`` pairs ``policy`` makes units, children before parents.

    The walk is the one FairScale and FSDP1 run (``_recursive_wrap``): count the subtree's
    parameters, ask whether to recurse, handle the children, then ask whether to wrap with
    the count the children left. The root is handled as FSDP1 does (``only_wrap_children``):
    it is not in the list, since every engine wraps it last anyway.

    Raises:
        TypeError: If ``policy`` is not a :class:`WrapPolicy`.

    Examples:
        >>> model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 2))
        >>> [name for name, _ in selected_modules(model, SizePolicy(1000))]
        ['0']
    """
    if not isinstance(policy, WrapPolicy):
        raise TypeError(
            f"policy must be a WrapPolicy (SizePolicy, LayerPolicy, ...), got {policy!r}"
        )
    selected: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, name: str, is_root: bool) -> int:
        numel = sum(p.numel() for p in module.parameters())
        if not policy.should_recurse(module, numel):
            return 0
        wrapped = 0
        for child_name, child in module.named_children():
            wrapped += visit(child, f"{name}.{child_name}" if name else child_name, False)
        if not is_root and policy.should_wrap(module, numel - wrapped):
            selected.append((name, module))
            return numel
        return wrapped

    visit(model, "", True)
    return selected
