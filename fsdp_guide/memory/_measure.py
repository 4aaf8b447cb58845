"""Measuring what a rank holds: model state by storage, and the device's peak (private)."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from fsdp_guide.engines import GRAD_BUFFERS, PARAM_BUFFERS, engine_for, local_tensor
from fsdp_guide.memory._state import ModelState


class _StorageCounter:
    """Adds up storage bytes, each storage once (keyed by device and data pointer)."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def add(self, tensors: Iterable[Any]) -> int:
        total = 0
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = local_tensor(tensor).untyped_storage()
            key = (str(storage.device), storage.data_ptr())
            # Meta tensors (DeepSpeed keeps some to describe shapes) hold no bytes.
            if storage.device.type == "meta" or storage.nbytes() == 0 or key in self._seen:
                continue
            self._seen.add(key)
            total += storage.nbytes()
        return total


def _optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[Any]:
    """Tensors in the optimizer's state and in a wrapped local optimizer's (OSS, ZeRO)."""
    optimizers: list[Any] = [optimizer]
    inner = getattr(optimizer, "optim", None)  # OSS and ZeroRedundancyOptimizer: local shard
    if isinstance(inner, torch.optim.Optimizer):
        optimizers.append(inner)
    tensors: list[Any] = []
    for opt in optimizers:
        for per_param in opt.state.values():
            tensors.extend(per_param.values())
    return tensors


def measure_model_state(
    module: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> ModelState:
    """Bytes of parameters, gradients and optimizer state that this rank holds.

    Meant to be called after ``optimizer.step()`` and before ``optimizer.zero_grad()``
    (see the module docstring for what each strategy holds there). Works on a plain
    module and on the wrapped module of every strategy: DDP, ShardedDDP, FSDP1 (flat
    parameter shards), FSDP2 (DTensor local shards) and FairScale FSDP; and on plain,
    ZeroRedundancyOptimizer and OSS optimizers (their local shard). Bytes on any device
    are counted; each storage once.

    A DeepSpeed engine (any ZeRO stage, offload too) is measured with its own optimizer:
    pass the engine, and ``None`` or ``engine.optimizer``; the module inside it with
    ``engine.optimizer`` works too. Its fp32 master copy is reported as ``master``, its
    reduce buckets as ``buckets``; call it after ``engine.step()``, which has already
    cleared the gradients (see :func:`~fsdp_guide.memory.estimate_deepspeed_state`).

    Args:
        module: The model as trained (the wrapper, the bare module, or a DeepSpeed engine).
        optimizer: Its optimizer, or ``None`` to count no optimizer state (for a DeepSpeed
            engine, ``None`` means the engine's own).

    Returns:
        The measured ``ModelState``.

    Raises:
        TypeError: When ``module`` is not an ``nn.Module`` or ``optimizer`` not an optimizer.
        ValueError: When a DeepSpeed engine is given an optimizer other than its own.

    Examples:
        >>> model = nn.Linear(10, 10)  # 110 parameters
        >>> opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(2, 10)).sum().backward()
        >>> opt.step()
        >>> measure_model_state(model, opt)  # Adam: two moments + a 4-byte step per tensor
        ModelState(params=440, grads=440, optimizer=888, total=1768)
        >>> measure_model_state(model)
        ModelState(params=440, grads=440, optimizer=0, total=880)

        DDP's gradient buckets stay allocated for the whole run, ``zero_grad()`` or not.
        With ``gradient_as_bucket_view=True`` they are the gradients' storage, counted as
        ``grads`` even while every ``.grad`` is None; without it they are a second copy of
        the gradients, reported as ``buckets`` (see ``ModelState``).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    # An engine whose state the walk below would miss lists its tensors (DeepSpeed's).
    engine = engine_for(module, optimizer)
    optimizer = engine.optimizer_of(module, optimizer)
    held = engine.state_tensors(module, optimizer)
    if held is not None:
        return _measure_listed(held)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    counter = _StorageCounter()
    params = [*module.parameters(), *_fsdp1_flat_params(module)]
    param_buffers = [getattr(p, name, None) for p in params for name in PARAM_BUFFERS]
    grad_buffers = [getattr(p, name, None) for p in params for name in GRAD_BUFFERS]
    param_bytes = counter.add([*params, *param_buffers])
    unsharded = engine.held_grads(module)  # FSDP2's unsharded gradients while sync is off
    grad_bytes = counter.add([*(p.grad for p in params), *grad_buffers, *unsharded])
    optimizer_bytes = counter.add(_optimizer_state_tensors(optimizer)) if optimizer else 0
    bucket_grads, bucket_copies = _ddp_buckets(module)
    return ModelState(
        params=param_bytes,
        grads=grad_bytes + bucket_grads,
        optimizer=optimizer_bytes,
        buckets=bucket_copies,
    )


def _fsdp1_flat_params(module: nn.Module) -> list[Any]:
    """PyTorch FSDP1's flat parameters, registered on the module or not.

    With ``use_orig_params=True`` (Lightning's default) the module's parameters are views
    of each unit's flat parameter: of its shard, or of the gathered copy while the unit is
    unsharded. The shard is then reachable only through the flat parameter itself.
    """
    flats = []
    for sub in module.modules():
        flat = getattr(getattr(sub, "_handle", None), "flat_param", None)
        if isinstance(flat, torch.Tensor):
            flats.append(flat)
    return flats


def _measure_listed(tensors: dict[str, list[Any]]) -> ModelState:
    """Tensors listed by field; the order of the fields settles shared storages."""
    counter = _StorageCounter()
    counted = {name: counter.add(tensors[name]) for name in tensors}
    return ModelState(
        params=counted["params"],
        master=counted["master"],
        grads=counted["grads"],
        buckets=counted["buckets"],
        optimizer=counted["optimizer"],
    )


def _ddp_buckets(module: nn.Module) -> tuple[int, int]:
    """Bytes of DDP's gradient buckets: (those that hold the gradients and no ``.grad``
    shows, those that are a second copy of the gradients).

    The reducer allocates its buckets when the model is wrapped and keeps them for the whole
    run. With ``gradient_as_bucket_view=True`` they are the gradients' storage: a ``.grad``
    that is set is a view of one and the walk over the gradients has counted it; after
    ``zero_grad()`` (``.grad`` set to None) the bytes are still held, and are counted here
    as gradients. Without it the buckets are a second full-size copy, reported apart. The
    reducer does not expose its buckets to Python; its logging data gives their sizes in
    bytes (``"bucket_sizes"``, comma-separated; a rebuild regroups the same parameters, so
    their sum holds).
    """
    from torch.nn.parallel import DistributedDataParallel

    unseen_grads = copies = 0
    for sub in module.modules():
        if not isinstance(sub, DistributedDataParallel):
            continue
        data = sub._get_ddp_logging_data()  # type: ignore[no-untyped-call]
        sizes = str(data.get("bucket_sizes", ""))
        held = sum(int(size) for size in sizes.split(",") if size.strip())
        if sub.gradient_as_bucket_view:
            # The gradients that are set are views of the buckets: count the rest of them.
            views = _StorageCounter().add(p.grad for p in sub.parameters())
            unseen_grads += max(0, held - views)
        else:
            copies += held
    return unseen_grads, copies


@dataclass(frozen=True)
class PeakMemory:
    """A peak memory reading and what it is.

    Attributes:
        bytes: The reading.
        kind: ``"cuda_peak_allocated"`` (``torch.cuda.max_memory_allocated``: tensors only)
            or ``"cpu_peak_rss"`` (the process's peak resident set: the interpreter, torch's
            libraries and every tensor; it is not model state).
    """

    bytes: int
    kind: Literal["cuda_peak_allocated", "cpu_peak_rss"]

    @property
    def label(self) -> str:
        """Human-readable name of the reading.

        Examples:
            >>> PeakMemory(10**9, "cpu_peak_rss").label
            'process peak RSS (not model state)'
        """
        if self.kind == "cuda_peak_allocated":
            return "CUDA peak allocated"
        return "process peak RSS (not model state)"


def peak_memory(device: torch.device | str | None = None) -> PeakMemory:
    """The peak memory of a CUDA device, or of this process on CPU.

    Args:
        device: A CUDA device to read ``max_memory_allocated`` from; ``None`` means the
            current CUDA device when CUDA is initialised, else the CPU process.

    Returns:
        A ``PeakMemory``, labelled with what it measures.

    Examples:
        >>> peak = peak_memory("cpu")
        >>> peak.kind, peak.bytes > 10_000_000
        ('cpu_peak_rss', True)
    """
    if device is None:
        use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    else:
        use_cuda = torch.device(device).type == "cuda"
    if use_cuda:
        peak = int(torch.cuda.max_memory_allocated(device))
        return PeakMemory(bytes=peak, kind="cuda_peak_allocated")
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB, macOS bytes
    return PeakMemory(bytes=int(max_rss) * scale, kind="cpu_peak_rss")
