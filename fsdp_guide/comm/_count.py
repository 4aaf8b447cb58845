"""Counting the collectives a rank issues: calls, elements and bytes per kind (private).

:func:`count_collectives` pushes a ``TorchDispatchMode`` that sees every ``torch.ops.c10d``
op issued on the calling thread: DDP's C++ reducer, FairScale OSS and ShardedDDP, FSDP1 and
FSDP2 all reach the process group through those ops, with their exact tensors. A dispatch
mode is thread-local, so collectives issued from another thread (the ``.then`` callbacks of
a DDP communication hook such as PowerSGD run on gloo's threads) are not seen. The counter
notices them through the process groups' sequence numbers, which every collective of a group
advances whichever thread issues it, and marks the result ``complete=False`` with a reason:
a short count is never silent. With ``all_threads=True`` the counter also counts the
``torch.distributed`` calls (``all_reduce``, ``all_gather``, ...) that other threads make
while the block runs, which is how such callbacks communicate.

**Payload, the unit counted.** For each collective, the elements of the *logical* tensor it
works on: the tensor all-reduced, broadcast or reduced; the full (input) tensor of a
reduce-scatter; the full (output) tensor of an all-gather; the input of an all-to-all; the
tensor sent or received. That is the unit of the ZeRO paper's Ψ: an all-reduce of the
gradients is "Ψ" of payload, whatever algorithm moves it. See
:func:`fsdp_guide.comm.predict_communication` for how payload relates to the paper's
"2Ψ" and to the bytes a ring really sends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_guide.comm._stats import COLLECTIVE_KINDS, CollectiveCount, CollectiveKind, CommStats

# c10d op name -> (kind, index of the argument whose tensors are the payload).
_OPS: dict[str, tuple[CollectiveKind, int]] = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "reduce_scatter_": ("reduce_scatter", 1),  # (outputs, inputs): the full tensors in
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allgather_": ("all_gather", 0),  # (outputs, inputs): the full tensors out
    "_allgather_base_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0),
    "alltoall_": ("all_to_all", 1),
    "alltoall_base_": ("all_to_all", 1),
    "gather_": ("gather", 1),
    "scatter_": ("scatter", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0),
    "barrier": ("barrier", 0),
    "monitored_barrier_": ("barrier", 0),
}


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def _process_group(args: Any) -> Any:
    """The op's process group: the script object among its arguments that unboxes to one."""
    for arg in args:
        if type(arg).__name__ == "ScriptObject":  # the group, or a ReduceOp
            try:
                return torch.distributed.ProcessGroup.unbox(arg)
            except RuntimeError:
                continue
    return None


class _Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records each c10d op: its kind, payload and process group; runs it unchanged."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: dict[str, list[Any]] = {}
        self.per_group: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        found = payload_of(func, args)
        if found is not None:
            kind, elements, nbytes, dtypes, group = found
            calls, total, total_bytes, seen = self.counts.setdefault(kind, [0, 0, 0, set()])
            self.counts[kind] = [calls + 1, total + elements, total_bytes + nbytes, seen | dtypes]
            if group is not None:
                self.per_group[id(group)] = self.per_group.get(id(group), 0) + 1
        return func(*args, **(kwargs or {}))


# Functional collectives (``torch.ops._c10d_functional``, what DTensor and tensor parallelism
# issue): op -> kind. Their input is the payload, except an all-gather's: input times ranks.
_FUNCTIONAL: dict[str, CollectiveKind] = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


def payload_of(func: Any, args: Any) -> tuple[str, int, int, set[str], Any] | None:
    """(kind, elements, bytes, dtypes, process group) of a collective op, None for other ops.

    Both the ``c10d`` ops (``torch.distributed``'s calls) and the functional collectives
    (``_c10d_functional``, issued by DTensor) are recognised. A ``TorchDispatchMode`` calls
    it with each op it sees.

    Args:
        func: The op (``OpOverload``) a dispatch mode received.
        args: Its positional arguments.

    Examples:
        >>> payload_of(torch.ops.aten.add.Tensor, (torch.ones(2), torch.ones(2))) is None
        True
    """
    scale, group = 1, None
    if func.namespace == "c10d":
        kind, index = _OPS.get(func._opname, (None, 0))
        if kind is None:
            return None
        tensors = list(_tensors(args[index])) if kind != "barrier" else []
        group = _process_group(args)
    elif func.namespace == "_c10d_functional" and func._opname in _FUNCTIONAL:
        kind = _FUNCTIONAL[func._opname]
        tensors = list(_tensors(args[0]))
        if kind == "all_gather":
            scale = int(args[1])  # (input, group_size, group_name)
        group = _group_named(args[-1])
    else:
        return None
    elements = scale * sum(t.numel() for t in tensors)
    nbytes = scale * sum(t.numel() * t.element_size() for t in tensors)
    return kind, elements, nbytes, {str(t.dtype) for t in tensors}, group


def _group_named(name: Any) -> Any:
    """The process group a functional collective names, None if it cannot be resolved."""
    if not isinstance(name, str):
        return None
    from torch.distributed.distributed_c10d import (  # type: ignore[attr-defined]
        _resolve_process_group,
    )

    try:
        return _resolve_process_group(name)  # type: ignore[arg-type]
    except (RuntimeError, ValueError, KeyError):
        return None


def _sequence_numbers() -> dict[Any, int | None]:
    """Each live process group's collective sequence number (``None`` where unreadable)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return {}
    from torch.distributed.distributed_c10d import _world

    numbers: dict[Any, int | None] = {}
    for group in list(_world.pg_map):
        try:
            numbers[group] = int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]
        except (RuntimeError, AttributeError):  # a backend without sequence numbers
            numbers[group] = None
    return numbers


# ``torch.distributed`` functions that other threads may call while counting all threads:
# name -> (kind, the positional index and keyword of the argument holding the payload).
_PYTHON_CALLS: dict[str, tuple[CollectiveKind, int, str]] = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "broadcast": ("broadcast", 0, "tensor"),
    "reduce": ("reduce", 0, "tensor"),
    "all_gather": ("all_gather", 0, "tensor_list"),  # the full outputs
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "reduce_scatter": ("reduce_scatter", 1, "input_list"),  # the full inputs
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
}


class _OtherThreads:
    """Counts the ``torch.distributed`` calls made from threads other than ``thread``.

    While active, each function of :data:`_PYTHON_CALLS` is replaced, in ``torch.distributed``
    and in ``distributed_c10d`` where it is defined, by a wrapper that records the call's
    payload when it runs on another thread and then calls the original. Calls on ``thread``
    itself reach the dispatch mode, which counts them.
    """

    def __init__(self, thread: int) -> None:
        self.thread = thread
        self.lock = threading.Lock()
        self.counts: dict[str, list[Any]] = {}
        self.per_group: dict[int, int] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrapped(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        kind, index, keyword = _PYTHON_CALLS[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.thread:
                payload = args[index] if len(args) > index else kwargs.get(keyword)
                self._record(kind, list(_tensors(payload)), kwargs.get("group"))
            return original(*args, **kwargs)

        call.__wrapped__ = original  # type: ignore[attr-defined]
        return call

    def _record(self, kind: str, tensors: list[torch.Tensor], group: Any) -> None:
        if group is None:
            group = torch.distributed.distributed_c10d._get_default_group()
        elements = sum(t.numel() for t in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        with self.lock:
            calls, total, total_bytes, seen = self.counts.setdefault(kind, [0, 0, 0, set()])
            dtypes = seen | {str(t.dtype) for t in tensors}
            self.counts[kind] = [calls + 1, total + elements, total_bytes + nbytes, dtypes]
            self.per_group[id(group)] = self.per_group.get(id(group), 0) + 1

    def __enter__(self) -> _OtherThreads:
        from torch.distributed import distributed_c10d

        for name in _PYTHON_CALLS:
            original = getattr(distributed_c10d, name)
            wrapper = self._wrapped(name, original)
            for module in (torch.distributed, distributed_c10d):
                if getattr(module, name, None) is original:
                    self._saved.append((module, name, original))
                    setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()


class CommCounter:
    """The live handle :func:`count_collectives` yields; read its ``stats`` after the block."""

    def __init__(self) -> None:
        self._stats: CommStats | None = None

    @property
    def stats(self) -> CommStats:
        """The counts, available once the ``with`` block has ended.

        Raises:
            RuntimeError: When read inside the block.
        """
        if self._stats is None:
            raise RuntimeError("read .stats after the `with count_collectives()` block ends")
        return self._stats


@contextmanager
def count_collectives(all_threads: bool = False) -> Iterator[CommCounter]:
    """Count the collectives this rank issues while the block runs, per kind.

    Every ``torch.ops.c10d`` op issued on this thread is counted with its exact tensors.
    Collectives issued from other threads are not counted, unless ``all_threads`` is set.
    Every process group (gloo, NCCL) advances a sequence number per collective,
    point-to-point included, whichever thread issues it: when a group advanced by more than
    was seen on it, the result says ``complete=False``, how many were missed and why.

    Args:
        all_threads: Also count the ``torch.distributed`` calls (``all_reduce``,
            ``broadcast``, ``reduce``, ``all_gather``, ``all_gather_into_tensor``,
            ``reduce_scatter``, ``reduce_scatter_tensor``) that other threads make during
            the block: the ``.then`` callbacks of a DDP communication hook such as
            PowerSGD's run on gloo's threads and communicate through them. The functions are
            replaced for the whole process while the block runs.

    Yields:
        A counter; its ``stats`` (a ``CommStats``) are the block's collectives once it ends.

    Raises:
        RuntimeError: Reading ``stats`` inside the block.

    Examples:
        Without a process group nothing is issued, and the count is complete:

        >>> with count_collectives() as counter:
        ...     _ = torch.ones(3) * 2
        >>> counter.stats.calls, counter.stats.complete
        (0, True)
        >>> with count_collectives(all_threads=True) as counter:
        ...     _ = torch.ones(3) * 2
        >>> counter.stats.calls
        0
    """
    counter = CommCounter()
    before = _sequence_numbers()
    thread = threading.get_ident()
    mode = _Mode()
    others = _OtherThreads(thread)
    with contextlib.ExitStack() as stack:
        if all_threads:
            stack.enter_context(others)
        with mode:
            yield counter
    if threading.get_ident() != thread:  # pragma: no cover - contextmanager keeps the thread
        raise RuntimeError("count_collectives must end on the thread it started on")
    after = _sequence_numbers()
    unseen, unreadable = 0, []
    for key, count in others.per_group.items():
        mode.per_group[key] = mode.per_group.get(key, 0) + count
    for kind, (calls, elements, nbytes, dtypes) in others.counts.items():
        have = mode.counts.setdefault(kind, [0, 0, 0, set()])
        mode.counts[kind] = [
            have[0] + calls,
            have[1] + elements,
            have[2] + nbytes,
            have[3] | dtypes,
        ]
    for group, start in before.items():
        end = after.get(group)
        seen = mode.per_group.get(id(group), 0)
        if start is None or end is None:
            if seen:
                unreadable.append(type(group).__name__)
            continue
        unseen += max(0, end - start - seen)
    reasons = []
    if unseen:
        reasons.append(
            f"{unseen} collective(s) were issued from another thread (a DDP communication "
            "hook's callbacks, say) and are not in the counts; count_collectives("
            "all_threads=True) counts them"
        )
    if unreadable:
        reasons.append("a process group has no sequence number, so other threads are unchecked")
    kinds: dict[str, CollectiveCount] = {
        kind: CollectiveCount(calls=c[0], elements=c[1], bytes=c[2], dtypes=tuple(sorted(c[3])))
        for kind in COLLECTIVE_KINDS
        if (c := mode.counts.get(kind)) is not None
    }
    counter._stats = CommStats(
        kinds=kinds, complete=not reasons, reason="; ".join(reasons), unseen_calls=unseen
    )
