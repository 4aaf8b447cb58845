"""DeepSpeed inside a launched rank: CPU preparation, the engine, one training step (private)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from torch import nn

from fsdp_guide.deepspeed._preflight import check_installed


def prepare_cpu() -> None:
    """Point DeepSpeed at the CPU when no GPU is visible; call before ``import deepspeed``.

    DeepSpeed picks its accelerator once, from ``DS_ACCELERATOR`` or by probing for CUDA
    and other devices, and keeps it for the life of the process. A value the user set is
    left alone. Inside a launched rank :func:`import_deepspeed` decides from the rank's
    device instead, so gloo ranks on a machine with a GPU use the CPU accelerator too.

    Examples:
        >>> prepare_cpu()
        >>> os.environ.get("DS_ACCELERATOR") in (None, "cpu", "cuda") or "set by the user"
        True
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def rank_accelerator() -> str | None:
    """The DeepSpeed accelerator this process should use: its rank's device type, if any.

    ``"cuda"`` or ``"cpu"`` inside a process group (from
    :func:`~fsdp_guide.launcher.rank_device`: a gloo rank computes on the CPU even where a
    GPU is visible, and DeepSpeed must then not pick CUDA); outside one, ``"cpu"`` when no
    GPU is visible and ``None`` (let DeepSpeed probe) otherwise.

    Examples:
        >>> rank_accelerator() in ("cpu", None)  # no process group here
        True
    """
    import torch.distributed as dist

    from fsdp_guide.launcher import rank_device

    if dist.is_available() and dist.is_initialized():
        return rank_device().type
    return None if torch.cuda.is_available() else "cpu"


def _check_accelerator(deepspeed: ModuleType, wanted: str | None) -> None:
    """Refuse a DeepSpeed imported earlier with another accelerator than the rank's device."""
    if wanted is None or os.environ.get("DS_ACCELERATOR") not in (None, wanted):
        return  # nothing to compare with, or the user chose on purpose
    name = deepspeed.get_accelerator().device_name()
    if name != wanted:
        raise RuntimeError(
            f"DeepSpeed runs on its {name!r} accelerator in this process but the rank computes "
            f"on {wanted!r}: DeepSpeed picks its accelerator once, at its first use, and the "
            f"ranks inherited it. Set DS_ACCELERATOR={wanted} before DeepSpeed is first used "
            "in the notebook or script, or do not use it there before launching"
        )


@contextmanager
def _linker_probes_silenced() -> Iterator[None]:
    """Send file descriptor 2 to ``/dev/null`` for a moment, output of child processes included.

    DeepSpeed asks which of its ops this machine could build by compiling small test
    programs (on the first read of ``deepspeed.ops.__compatible_ops__``); where a library
    is missing (``libaio`` for NVMe offload) the linker's complaint lands on the terminal,
    or in a notebook's output, for an op we never use.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def import_deepspeed() -> ModuleType:
    """Import DeepSpeed ready to run here: the rank's accelerator, no compiled comm op.

    The accelerator is the rank's device's (a gloo rank's is the CPU), unless
    ``DS_ACCELERATOR`` says otherwise.

    On CPU, ``deepspeed.init_distributed`` builds its shared-memory collectives op
    (``deepspeed_shm_comm``) with the C++ compiler in every new process: 75 s the first
    time, and a failed init where no compiler is installed. Gloo does the same collectives
    without it, so the op is marked incompatible before any process group is made.

    Returns:
        The ``deepspeed`` module.

    Raises:
        ValueError: ``MissingRequirementError``: DeepSpeed is not installed.
        RuntimeError: DeepSpeed was imported before, with another accelerator than the
            rank's device (a forked rank inherits its parent's choice).
    """
    check_installed()
    wanted = rank_accelerator()
    if "deepspeed" not in sys.modules and wanted is not None:
        os.environ.setdefault("DS_ACCELERATOR", wanted)
    import deepspeed
    import deepspeed.ops

    _check_accelerator(deepspeed, wanted)

    # The first read of __compatible_ops__ probes every op with the compiler.
    with _linker_probes_silenced():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    module: ModuleType = deepspeed
    return module


def is_engine(module: object) -> bool:
    """Whether ``module`` is a DeepSpeed engine (without importing DeepSpeed).

    Examples:
        >>> is_engine(nn.Linear(2, 2))
        False
    """
    if "deepspeed" not in sys.modules:
        return False  # an engine can only exist once DeepSpeed was imported
    from deepspeed import DeepSpeedEngine

    return isinstance(module, DeepSpeedEngine)


def initialize(model: nn.Module, config: Mapping[str, Any]) -> tuple[nn.Module, Any]:
    """Wrap ``model`` in a DeepSpeed engine inside a launched rank; build its optimizer.

    The process group of :func:`fsdp_guide.launch` (or ``torchrun``) is reused: DeepSpeed's
    communication backend wraps an initialised ``torch.distributed`` group instead of
    making its own. Without one, one is made from ``RANK``, ``WORLD_SIZE`` and
    ``MASTER_*`` (gloo on CPU, NCCL on GPUs).

    Args:
        model: The model, identical on every rank.
        config: A DeepSpeed config, e.g. :func:`~fsdp_guide.deepspeed.zero_config`.

    Returns:
        ``(engine, optimizer)``: the engine (an ``nn.Module``: call it for the forward pass)
        and DeepSpeed's optimizer (for ZeRO 1-3 a ZeRO optimizer wrapping torch's Adam,
        which is not a ``torch.optim.Optimizer``).

    Raises:
        ValueError: ``MissingRequirementError``: DeepSpeed is not installed.
    """
    deepspeed = import_deepspeed()
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=list(model.parameters()), config=dict(config)
    )
    return engine, optimizer


def backward_and_step(module: nn.Module, optimizer: Any, loss: torch.Tensor) -> None:
    """One optimizer step from ``loss``, for a DeepSpeed engine as for any other wrapper.

    A DeepSpeed engine owns the backward pass and the step (``engine.backward(loss)``
    reduces or partitions the gradients, ``engine.step()`` steps and zeroes them); every
    other strategy is ``loss.backward()`` and ``optimizer.step()``.

    Examples:
        >>> layer = nn.Linear(2, 1)
        >>> sgd = torch.optim.SGD(layer.parameters(), lr=0.5)
        >>> before = layer.weight.detach().clone()
        >>> backward_and_step(layer, sgd, layer(torch.ones(1, 2)).sum())
        >>> torch.equal(layer.weight, before - 0.5)
        True
    """
    if is_engine(module):
        engine: Any = module
        engine.backward(loss)
        engine.step()
        return
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
