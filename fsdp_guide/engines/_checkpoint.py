"""What engines share about checkpoints: the hooks' defaults and PyTorch's state-dict API (private).

:class:`~fsdp_guide.engines.Engine`'s checkpoint hooks answer for engines that keep the
whole model on every rank; PyTorch FSDP1 and FSDP2 answer through
:mod:`torch.distributed.checkpoint.state_dict` (``get_state_dict`` / ``set_state_dict``),
whose side effect on an optimizer without state :func:`kept_fresh` undoes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


@contextlib.contextmanager
def kept_fresh(optimizer: torch.optim.Optimizer | None) -> Iterator[bool]:
    """Keep an optimizer that has not stepped yet without state through DCP's state dict calls.

    ``get_state_dict`` and ``set_state_dict`` create the state of an optimizer that has none
    by stepping it once with lr 0: its step counts become 1 and its moments 0, which changes
    its next update (Adam's bias correction), so a checkpoint taken before the first step
    would change the run it was taken from. Yields whether ``optimizer`` has no state; if
    so, it has none again on leaving.

    Examples:
        >>> layer = nn.Linear(2, 1)
        >>> adam = torch.optim.Adam(layer.parameters())
        >>> with kept_fresh(adam) as fresh:
        ...     layer(torch.ones(1, 2)).sum().backward()
        ...     adam.step()
        >>> fresh, len(adam.state)
        (True, 0)
    """
    fresh = optimizer is not None and not optimizer.state
    try:
        yield fresh
    finally:
        if optimizer is not None and fresh:
            optimizer.state.clear()


def without_state(optim_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with its per-parameter state dropped (groups kept).

    Examples:
        >>> without_state({"state": {"w": {"step": 1}}, "param_groups": [{"lr": 0.1}]})
        {'state': {}, 'param_groups': [{'lr': 0.1}]}
    """
    return {**optim_state, "state": {}} if "param_groups" in optim_state else optim_state


def rank() -> int:
    """This process's rank in the default group, 0 without one."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def consolidated_everywhere(optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
    """An OSS optimizer's whole state, materialised on every rank (FairScale's recipient -1)."""
    if optimizer is None:
        return None
    optimizer.consolidate_state_dict(recipient_rank=-1)  # type: ignore[attr-defined]
    return optimizer.state_dict()


class TorchStateDict:
    """The checkpoint hooks of an engine whose state goes through
    ``torch.distributed.checkpoint.state_dict`` (PyTorch FSDP1 and FSDP2), mixed in before
    :class:`~fsdp_guide.engines.Engine`.

    Sharded values are ``ShardedTensor`` (FSDP1) or ``DTensor`` (FSDP2), keyed by the
    unwrapped parameter names, and so is the optimizer state: a DCP checkpoint of either
    loads into the other, at any world size.
    """

    def gather_to_rank0(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The full model and optimizer state on rank 0, empty dicts on the others (collective).

        Every rank takes part in the gathers, but only rank 0 keeps what is gathered, so no
        other rank ever holds the whole state.
        """
        raise NotImplementedError

    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The full state on rank 0, optimizer keyed by name; ``(None, None)`` elsewhere."""
        model_state, optim_state = self.gather_to_rank0(model, optimizer)
        if rank() != 0:
            return None, None
        return model_state, (optim_state if optimizer is not None else None)

    def expected_state(self, model: nn.Module) -> dict[str, Any]:
        """This rank's sharded state dict: unwrapped names, values of the whole shapes."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=False)))

    def load_full_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        model_state: dict[str, Any],
        optim_state: dict[str, Any] | None,
    ) -> None:
        """``set_state_dict`` from a full, name-keyed state; every rank keeps its shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(
            model,
            [optimizer] if optimizer is not None else [],
            model_state_dict=model_state,
            optim_state_dict=optim_state if optimizer is not None and optim_state else {},
            options=StateDictOptions(full_state_dict=True),
        )
        if optimizer is not None and optim_state is not None and not optim_state["state"]:
            optimizer.state.clear()  # saved before its first step: fresh, as it was then

    def sharded_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> dict[str, Any]:
        """This rank's shards (``get_state_dict``), an optimizer without state kept fresh."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        optimizers = [optimizer] if optimizer is not None else []
        with kept_fresh(optimizer) as fresh:
            model_state, optim_state = get_state_dict(
                model, optimizers, options=StateDictOptions(full_state_dict=False)
            )
        state: dict[str, Any] = {"model": model_state}
        if optimizer is not None:
            state["optimizer"] = without_state(dict(optim_state)) if fresh else optim_state
        return state
