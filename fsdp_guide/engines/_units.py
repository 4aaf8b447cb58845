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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from torch import nn

from fsdp_guide.engines._base import Engine


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
