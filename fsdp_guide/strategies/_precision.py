"""Precision plugins whose gradient clipping goes through the sharded optimizer or model.

With OSS each rank only holds the reduced gradients of its own shard, so
``torch.nn.utils.clip_grad_norm_`` on one rank would see a partial norm. These plugins
compute the norm across ranks with ``OSS.clip_grad_norm`` (or
FairScale FSDP's ``clip_grad_norm_``) and, for fp16 on CUDA, unscale gradients with
FairScale's ``ShardedGradScaler``, which agrees on
``inf`` across ranks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from torch import nn
from torch.optim import Optimizer

_FP16_NEEDS_CUDA = (
    "precision='16-mixed' with sharding needs CUDA; use precision='bf16-mixed' on CPU"
)


def _clip_sharded(optimizer: Optimizer, model: nn.Module | None, clip_val: float) -> bool:
    """Clip through OSS or FairScale FSDP; return False when neither applies."""
    from fairscale.nn import FullyShardedDataParallel
    from fairscale.optim import OSS

    inner = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
    if isinstance(inner, OSS):
        inner.clip_grad_norm(clip_val)
        return True
    if isinstance(model, FullyShardedDataParallel):
        model.clip_grad_norm_(clip_val)
        return True
    return False


class ShardedPrecision(Precision):
    """Full precision (``"32-true"``) with clipping by norm done across shards.

    Examples:
        >>> ShardedPrecision().sharded_model is None
        True
    """

    sharded_model: nn.Module | None = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip the global gradient norm, computed across all ranks' shards."""
        if not _clip_sharded(optimizer, self.sharded_model, float(clip_val)):
            super().clip_grad_by_norm(optimizer, clip_val)


# Lightning 1.x's spellings of the precision flag, as its sharded plugin took them.
_LIGHTNING_1X_PRECISION: dict[object, str] = {
    16: "16-mixed",
    "16": "16-mixed",
    "bf16": "bf16-mixed",
    32: "32-true",
    "32": "32-true",
}
MixedFlag = Literal["16-mixed", "bf16-mixed", "32-true", 16, "16", "bf16", 32, "32"]


class ShardedMixedPrecision(MixedPrecision):
    """``torch.autocast`` mixed precision with a shard-aware grad scaler and clipping.

    Lightning 1.x's ``ShardedNativeMixedPrecisionPlugin`` also took ``16``, ``"bf16"`` and
    ``32``; they are accepted as ``"16-mixed"``, ``"bf16-mixed"`` and ``"32-true"``. At
    ``"32-true"`` nothing is cast and there is no scaler: full precision, with the
    shard-aware clipping (what ``ShardedPrecision`` does).

    Args:
        precision: ``"16-mixed"`` (CUDA only, scaled with ``ShardedGradScaler``),
            ``"bf16-mixed"`` (CPU or CUDA, no scaler) or ``"32-true"`` (no autocast, no
            scaler), or the 1.x spellings above.
        device: ``"cuda"`` or ``"cpu"``.
        scaler: A scaler to use instead of a new ``ShardedGradScaler`` (fp16 only).

    Raises:
        ValueError: For ``"16-mixed"`` on a device other than CUDA, or another precision.

    Examples:
        >>> ShardedMixedPrecision("bf16-mixed", "cpu").scaler is None
        True
        >>> plugin = ShardedMixedPrecision(32, "cuda")  # as Lightning 1.x allowed
        >>> plugin.precision, plugin.scaler
        ('32-true', None)
    """

    sharded_model: nn.Module | None = None

    def __init__(self, precision: MixedFlag, device: str, scaler: Any = None) -> None:
        flag = _LIGHTNING_1X_PRECISION.get(precision, precision)
        if flag == "32-true":
            if scaler is not None:
                raise ValueError("precision 32 trains in full precision and takes no scaler")
            # MixedPrecision refuses this flag; the plugin keeps its attributes, casting nothing.
            self.precision = "32-true"
            self.device = device
            self.scaler = None
            return
        if flag == "16-mixed":
            if device != "cuda":
                raise ValueError(_FP16_NEEDS_CUDA)
            if scaler is None:
                from fairscale.optim.grad_scaler import ShardedGradScaler

                scaler = ShardedGradScaler()
        super().__init__(flag, device, scaler)  # type: ignore[arg-type]

    def autocast_context_manager(self) -> Any:
        """``torch.autocast`` for the 16-bit flags; no casting at all for ``"32-true"``."""
        if self.precision == "32-true":
            return contextlib.nullcontext()
        return super().autocast_context_manager()

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip the global gradient norm (already unscaled), computed across all shards."""
        if not _clip_sharded(optimizer, self.sharded_model, float(clip_val)):
            super().clip_grad_by_norm(optimizer, clip_val)


def check_sharded_precision(plugin: Precision) -> None:
    """Raise for a precision the FairScale strategies cannot train with.

    Called when the Trainer is created, so the error comes before any rank starts; it builds
    nothing (no grad scaler, no CUDA call).

    Args:
        plugin: The plugin Lightning chose for the ``Trainer(precision=...)`` flag.

    Raises:
        ValueError: For ``"16-mixed"`` off CUDA, or ``"16-true"``, ``"bf16-true"``, ``"64-true"``.

    Examples:
        >>> check_sharded_precision(MixedPrecision("bf16-mixed", "cpu"))
        >>> check_sharded_precision(MixedPrecision("16-mixed", "cpu"))
        Traceback (most recent call last):
        ...
        ValueError: precision='16-mixed' with sharding needs CUDA; use precision='bf16-mixed' on CPU
    """
    if isinstance(plugin, ShardedPrecision | ShardedMixedPrecision) or type(plugin) is Precision:
        return
    if isinstance(plugin, MixedPrecision):
        if plugin.precision == "16-mixed" and plugin.device != "cuda":
            raise ValueError(_FP16_NEEDS_CUDA)
        return
    raise ValueError(
        f"{type(plugin).__name__} (precision={getattr(plugin, 'precision', '?')!r})"
        " is not supported by the FairScale strategies;"
        " use precision='32-true', 'bf16-mixed' or '16-mixed' (CUDA)"
    )


def to_sharded_precision(plugin: Precision) -> ShardedPrecision | ShardedMixedPrecision:
    """The shard-aware equivalent of a Lightning precision plugin.

    Args:
        plugin: The plugin Lightning chose for the ``Trainer(precision=...)`` flag.

    Returns:
        The plugin itself when it is already shard-aware, else a new shard-aware one.

    Raises:
        ValueError: For precisions the FairScale strategies do not support
            (``"16-true"``, ``"bf16-true"``, ``"64-true"``, ...).

    Examples:
        >>> type(to_sharded_precision(Precision())).__name__
        'ShardedPrecision'
        >>> to_sharded_precision(MixedPrecision("bf16-mixed", "cpu")).precision
        'bf16-mixed'
    """
    check_sharded_precision(plugin)
    if isinstance(plugin, ShardedPrecision | ShardedMixedPrecision):
        return plugin
    if isinstance(plugin, MixedPrecision):
        # A user-made plain torch GradScaler would not agree on inf across ranks: replace it.
        precision: Literal["16-mixed", "bf16-mixed"] = (
            "16-mixed" if plugin.precision == "16-mixed" else "bf16-mixed"
        )
        return ShardedMixedPrecision(precision, plugin.device)
    return ShardedPrecision()


def _get_plugin(strategy: Any) -> Precision:
    """The strategy's shard-aware precision plugin (32-bit when none was set)."""
    if strategy._precision_plugin is None:
        strategy._precision_plugin = ShardedPrecision()
    plugin: Precision = strategy._precision_plugin
    return plugin


def _set_plugin(strategy: Any, plugin: Precision | None) -> None:
    strategy._precision_plugin = None if plugin is None else to_sharded_precision(plugin)


def shard_aware_precision_plugin() -> property:
    """A ``precision_plugin`` property that turns any plugin set into its shard-aware twin.

    Lightning 1.x chose the FairScale plugin while building the ``Trainer``; Lightning 2.x
    builds its own plugin and assigns it to ``strategy.precision_plugin`` before the strategy
    is used. Converting in that setter restores the 1.x behaviour: right after
    ``Trainer(...)``, ``trainer.precision_plugin`` is already shard-aware, and an unsupported
    precision fails there, before any rank starts. A property rather than a base class, so
    the strategies' documented bases stay Lightning's.

    Returns:
        The property, for a strategy's class body: ``precision_plugin = shard_aware_...()``.

    Examples:
        >>> class Holder:
        ...     _precision_plugin = None
        ...     precision_plugin = shard_aware_precision_plugin()
        >>> holder = Holder()
        >>> holder.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
        >>> type(holder.precision_plugin).__name__
        'ShardedMixedPrecision'
    """
    return property(_get_plugin, _set_plugin, doc=_get_plugin.__doc__)
