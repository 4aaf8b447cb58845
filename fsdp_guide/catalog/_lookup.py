"""Looking strategies up: by name or alias, as a ZeRO stage, runnable here or not (private)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable

from fsdp_guide.catalog._table import STRATEGIES, StrategySpec
from fsdp_guide.errors import MissingRequirementError

_BY_ALIAS: dict[str, str] = {a: s.name for s in STRATEGIES.values() for a in s.aliases}


def _choices() -> str:
    return ", ".join(STRATEGIES)


def get_strategy(name: str) -> StrategySpec:
    """The spec of a strategy, by its name or an alias.

    Raises:
        ValueError: For an unknown name, listing the known ones.

    Examples:
        >>> get_strategy("fsdp1").name, get_strategy("zero").zero_stage
        ('fsdp', 1)
        >>> get_strategy("zero4")
        Traceback (most recent call last):
        ...
        ValueError: unknown strategy 'zero4'; choose from ddp, zero1, oss, sharded_ddp, ...
    """
    spec = STRATEGIES.get(_BY_ALIAS.get(name, name)) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown strategy {name!r}; choose from {_choices()}")
    return spec


def resolve_stage(stage: int | str) -> int:
    """ZeRO stage number from a number, ``"zero0"`` to ``"zero3"``, or any strategy name.

    Raises:
        ValueError: For an unknown name or a number outside 0 to 3.

    Examples:
        >>> resolve_stage(3), resolve_stage("zero3"), resolve_stage("sharded_ddp")
        (3, 3, 2)
        >>> resolve_stage("fsdp1"), resolve_stage("fsdp_grad_op")
        (3, 2)
        >>> resolve_stage("zero9")
        Traceback (most recent call last):
        ...
        ValueError: unknown stage 'zero9'; use 0-3, zero0-zero3 or a strategy: ddp, zero1, ...
    """
    if isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage <= 3:
        return stage
    if isinstance(stage, str):
        if stage in ("zero0", "zero1", "zero2", "zero3"):
            return int(stage[-1])
        name = _BY_ALIAS.get(stage, stage)
        if name in STRATEGIES:
            return STRATEGIES[name].zero_stage
    raise ValueError(f"unknown stage {stage!r}; use 0-3, zero0-zero3 or a strategy: {_choices()}")


def extra_installed(extra: str) -> bool:
    """Whether the package of an optional extra would import (it is not imported here).

    Examples:
        >>> extra_installed("torch"), extra_installed("no_such_package_here")
        (True, False)
    """
    return extra in sys.modules or importlib.util.find_spec(extra) is not None


def install_command(extra: str) -> str:
    """The command that installs an optional extra, pinned like the rest of the project.

    From a checkout, the way the install page installs everything else (the package is not on
    the package index yet).

    Examples:
        >>> install_command("deepspeed")
        'pip install -c requirements/constraints.txt -e ".[deepspeed]"'
    """
    return f'pip install -c requirements/constraints.txt -e ".[{extra}]"'


def check_strategies(
    names: Iterable[str], *, cuda: bool | None = None, installed: bool = True
) -> list[StrategySpec]:
    """Look up strategy names, refusing unknown, repeated and unrunnable ones.

    Args:
        names: Names or aliases.
        cuda: Whether a GPU is visible; asked of torch when not given.
        installed: Refuse strategies whose optional extra is missing (DeepSpeed's);
            ``False`` to plan them without running them.

    Returns:
        The specs, in the order given.

    Raises:
        ValueError: For an empty list, an unknown or repeated name, or a CUDA-only strategy
            without CUDA.
        ValueError: ``MissingRequirementError``: For a DeepSpeed strategy without the
            ``deepspeed`` extra, naming the command that installs it.

    Examples:
        >>> [s.name for s in check_strategies(["ddp", "fsdp1"])]
        ['ddp', 'fsdp']
        >>> check_strategies(["fsdp", "fsdp1"])
        Traceback (most recent call last):
        ...
        ValueError: strategy 'fsdp' is given twice (as 'fsdp1'); name each strategy once
        >>> check_strategies(["fairscale_fsdp"], cuda=False)
        Traceback (most recent call last):
        ...
        ValueError: strategy 'fairscale_fsdp' needs CUDA, and no GPU is visible; leave it out
    """
    specs: list[StrategySpec] = []
    for name in names:
        spec = get_strategy(name)
        if spec in specs:
            again = "" if name == spec.name else f" (as {name!r})"
            raise ValueError(
                f"strategy {spec.name!r} is given twice{again}; name each strategy once"
            )
        if spec.needs_cuda:
            if cuda is None:
                import torch

                # NVML's count where it works: is_available() would initialise CUDA here.
                cuda = torch.cuda.device_count() > 0
            if not cuda:
                raise ValueError(
                    f"strategy {spec.name!r} needs CUDA, and no GPU is visible; leave it out"
                )
        for extra in sorted(spec.needs - {"cuda"}) if installed else []:
            if not extra_installed(extra):
                raise MissingRequirementError(
                    f"strategy {spec.name!r} needs the optional extra {extra!r}, which is not "
                    f"installed: {install_command(extra)}"
                )
        specs.append(spec)
    if not specs:
        raise ValueError("no strategy given; name at least one, e.g. ddp,fsdp")
    return specs


def cpu_strategies(*, deepspeed: bool = True) -> list[str]:
    """The catalog's names that run on CPU ranks under gloo, in catalog order.

    Args:
        deepspeed: Include the DeepSpeed stages (they need the ``deepspeed`` extra, and an
            engine steps through ``engine.backward``/``engine.step``).

    Examples:
        >>> "fairscale_fsdp" in cpu_strategies()  # FairScale's FSDP needs CUDA
        False
        >>> [n for n in cpu_strategies(deepspeed=False) if n.startswith("deepspeed")]
        []
    """
    return [
        name
        for name, spec in STRATEGIES.items()
        if not spec.needs_cuda and (deepspeed or "deepspeed" not in spec.needs)
    ]
