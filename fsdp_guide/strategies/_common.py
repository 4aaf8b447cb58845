"""Helpers shared by the FairScale strategies: argument checks and optimizer plumbing."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from torch.optim import Optimizer


def check_extra_kwargs(
    kwargs: dict[str, Any], target: Callable[..., Any], strategy: str, excluded: Iterable[str] = ()
) -> None:
    """Reject keyword arguments that ``target`` (a FairScale wrapper) does not accept.

    Raises before any process starts, instead of at wrap time on every rank.

    Args:
        kwargs: The extra keyword arguments given to a strategy's constructor.
        target: The callable that will receive them.
        strategy: The strategy's class name, for the message.
        excluded: Parameters of ``target`` the strategy sets itself.

    Raises:
        TypeError: Naming the unknown arguments and the accepted ones.

    Examples:
        >>> def wrapper(module, bucket_mb=25, broadcast=True): ...
        >>> check_extra_kwargs({"bucket_mb": 10}, wrapper, "MyStrategy", excluded=["module"])
        >>> check_extra_kwargs({"bukcet_mb": 10}, wrapper, "MyStrategy", excluded=["module"])
        Traceback (most recent call last):
        ...
        TypeError: MyStrategy got unknown argument(s) ['bukcet_mb']; accepted: broadcast, ...
    """
    params = inspect.signature(target).parameters
    accepted = sorted(
        name
        for name, p in params.items()
        if name not in set(excluded) and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(
            f"{strategy} got unknown argument(s) {unknown}; accepted: {', '.join(accepted)}"
            " (plus the standard Lightning strategy arguments)"
        )


def notebook_start_method(start_method: str, strategy: str, interactive: bool) -> str:
    """``"fork"`` instead of ``"popen"`` in an interactive session, else ``start_method``.

    Lightning's ``"popen"`` launcher re-runs the script for the other ranks, which a notebook
    cannot do: the Trainer refuses it there. Forking the kernel is what works.

    Args:
        start_method: The start method the strategy was given.
        strategy: The strategy's class name, for the message.
        interactive: Whether this is an interactive session (Jupyter, IPython).

    Returns:
        The start method to use.

    Examples:
        >>> notebook_start_method("popen", "MyStrategy", interactive=False)
        'popen'
        >>> notebook_start_method("spawn", "MyStrategy", interactive=True)
        'spawn'
    """
    if start_method != "popen" or not interactive:
        return start_method
    from pytorch_lightning.utilities import rank_zero_info

    rank_zero_info(f"{strategy}: interactive session, starting ranks with fork")
    return "fork"


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer behind a LightningOptimizer (or the optimizer itself).

    Examples:
        >>> import torch
        >>> sgd = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        >>> unwrap_optimizer(sgd) is sgd
        True
    """
    inner: Optimizer = getattr(optimizer, "_optimizer", optimizer)
    return inner


def retarget_schedulers(schedulers: Iterable[Any], old: Optimizer, new: Optimizer) -> int:
    """Point LR schedulers of ``old`` at ``new``; return how many were moved.

    The new optimizer's ``step`` is marked the way torch schedulers mark it, so they do not
    warn that ``optimizer.step()`` was replaced.

    Examples:
        >>> import torch
        >>> params = list(torch.nn.Linear(2, 2).parameters())
        >>> old, new = torch.optim.SGD(params, lr=1.0), torch.optim.SGD(params, lr=1.0)
        >>> sched = torch.optim.lr_scheduler.StepLR(old, step_size=1)
        >>> retarget_schedulers([sched], old, new), sched.optimizer is new
        (1, True)
    """
    moved = 0
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is old:
            scheduler.optimizer = new
            moved += 1
    if moved and not hasattr(new.step, "_wrapped_by_lr_sched"):
        step = new.step

        @functools.wraps(step)
        def tracked_step(*args: Any, **kwargs: Any) -> Any:
            new._opt_called = True  # type: ignore[attr-defined]
            return step(*args, **kwargs)

        tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        new.step = tracked_step  # type: ignore[method-assign]
    return moved


def constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's hyper-parameters that its class constructor accepts.

    ``optimizer.defaults`` can hold keys the constructor does not take (torch's ``AdamW``
    stores ``decoupled_weight_decay``), so they are filtered by the signature.

    Examples:
        >>> import torch
        >>> adamw = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.5)
        >>> defaults = constructor_defaults(adamw)
        >>> key = "decoupled_weight_decay"
        >>> defaults["lr"], key in adamw.defaults, key in defaults
        (0.5, True, False)
    """
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}
