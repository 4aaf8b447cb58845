"""A step's activations over time, traced on fake tensors: forward, loss and backward (private).

:func:`fsdp_guide.wrap.saved_activation_bytes` counts what autograd holds when forward
returns; a step holds more than that at its peak. Forward holds the running layer's
temporaries beside what is saved so far; backward the gradients flowing back through the
layers, the loss's (a large vocabulary's logits: their softmax and gradient, in fp32), and
for a checkpointed layer its whole forward run again. :func:`traced_profile` runs the
model's forward, its loss and its backward on fake tensors, as the trace of the saved
activations does (:mod:`fsdp_guide.memory._trace`), and follows every storage an op
creates until it is freed: what one process holds, parameters and their gradients apart.

Backward is cut into stretches at the units of the plan's wrap policy (a transformer block
each, by default): the loss and the layers after the last unit, each unit's backward (the
last unit first), and the layers before the first. A :class:`~fsdp_guide.engines.Stretch`
says what activations are held as one starts and at most during it, and which parameter
gradients it produces; each engine adds what it holds at those moments
(:meth:`fsdp_guide.engines.Engine.step_peak`).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_guide.engines import Stretch, UnitPolicy, UnitRule, unit_names
from fsdp_guide.errors import PlanError
from fsdp_guide.memory._trace import (
    BatchBuilder,
    Checkpointing,
    MixedPrecisionKind,
    _cannot_trace,
    _checkpoint,
    _default_batch,
    _make_batch,
    _meta_copy,
    _OnRealData,
    _quiet_tracer,
    _to_fake,
    check_sizes,
)
from fsdp_guide.memory._zero import Precision


@dataclass(frozen=True, kw_only=True)
class ActivationProfile:
    """What a step's activations hold over time on one process.

    Attributes:
        saved: Bytes autograd holds for backward when forward (and the loss) returns, what
            :func:`fsdp_guide.wrap.saved_activation_bytes` counts.
        forward: Forward and the loss in stretches, cut where a unit starts and ends.
        stretches: Backward in stretches, in the order it runs them; their ``grads``,
            ``largest_grad`` and the gradients of their ``moments`` count elements here (the
            plan makes them bytes at the engine's gradient precision).
    """

    saved: int
    forward: tuple[Stretch, ...]
    stretches: tuple[Stretch, ...]

    @property
    def forward_peak(self) -> int:
        """The most activation bytes held during forward and the loss."""
        return max(s.peak for s in self.forward)


class _Storages(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every storage an op creates, from that op until it is freed, on one clock.

    Fake storages sit at address 0: a storage is told apart by its ``StorageImpl``, whose
    address a later storage may take once it is freed, hence the serial number.
    """

    def __init__(self, skip: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.skip = skip  # the parameters' storages: views of them are no activations
        self.alive: dict[int, tuple[StorageWeakRef, int, int]] = {}
        self.events: list[tuple[int, int, int]] = []  # (op, serial, +bytes or -bytes)
        self.ops = 0
        self.serial = 0
        self.marks: list[tuple[int, str]] = []

    def release(self) -> None:
        for key, (ref, nbytes, serial) in list(self.alive.items()):
            if _expired(ref):
                del self.alive[key]
                self.events.append((self.ops, serial, -nbytes))

    def mark(self, name: str) -> None:
        self.release()
        self.marks.append((self.ops, name))

    def serial_of(self, tensor: Tensor) -> int | None:
        entry = self.alive.get(_ref(tensor.untyped_storage()).cdata)
        return None if entry is None else entry[2]

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.release()
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, Tensor):
                continue
            storage = tensor.untyped_storage()
            ref = _ref(storage)
            if ref.cdata in self.skip:
                continue
            old = self.alive.get(ref.cdata)
            if old is not None and _expired(old[0]):  # a new storage where a freed one was
                del self.alive[ref.cdata]
                self.events.append((self.ops, old[2], -old[1]))
                old = None
            if old is None:
                self.serial += 1
                self.alive[ref.cdata] = (ref, storage.nbytes(), self.serial)
                self.events.append((self.ops, self.serial, storage.nbytes()))
        return out


def _ref(storage: torch.UntypedStorage) -> StorageWeakRef:
    """A weak reference to ``storage``'s ``StorageImpl`` (its ``cdata`` tells it apart)."""
    return StorageWeakRef(storage)  # type: ignore[no-untyped-call]


def _expired(ref: StorageWeakRef) -> bool:
    return bool(ref.expired())  # type: ignore[no-untyped-call]


def _on_grad(tensor: Tensor, call: Callable[[], None]) -> None:
    """Call ``call`` when the gradient of ``tensor`` is computed."""
    tensor.register_hook(lambda grad: call())  # type: ignore[no-untyped-call]


def _first_grad_tensor(value: Any) -> Tensor | None:
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, Tensor) and leaf.requires_grad:
            return leaf
    return None


def _outer_units(model: nn.Module, policy: UnitRule | UnitPolicy) -> list[nn.Module]:
    """The policy's units that are inside no other unit (a unit of several modules joined
    by ``+``, as tied weights share one, marked module by module)."""
    names = [part for name in unit_names(model, policy) for part in name.split("+")]
    outer = [n for n in names if not any(n.startswith(f"{m}.") for m in names if m != n)]
    return [model.get_submodule(n) for n in outer]


@contextmanager
def _unit_marks(units: list[nn.Module], storages: _Storages, forward: list[bool]) -> Iterator[None]:
    """Mark where each unit starts and ends: in forward, as it is called and returns; in
    backward, when its output's gradient is ready and when its input's is (hooks taken in
    forward only, not while a checkpointed unit runs its forward again)."""
    handles = []

    def before(module: nn.Module, args: Any, kwargs: Any) -> None:
        if forward[0]:
            storages.mark("start")

    def after(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not forward[0]:
            return
        storages.mark("end")
        out, inp = _first_grad_tensor(output), _first_grad_tensor((args, kwargs))
        if out is not None:
            _on_grad(out, lambda: storages.mark("start"))
        if inp is not None:
            _on_grad(inp, lambda: storages.mark("end"))

    for module in units:
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _curve(storages: _Storages, grads: dict[int, int]) -> tuple[list[int], dict[int, list[int]]]:
    """Activation bytes held after each op, and the gradient elements each op made
    (``grads``: the gradients' storages by serial number, to their bytes per element)."""
    held = 0
    curve: list[int] = []
    made: dict[int, list[int]] = {}
    events = iter(sorted(storages.events))
    event = next(events, None)
    for op in range(storages.ops + 1):
        while event is not None and event[0] == op:
            _, serial, delta = event
            if serial in grads:
                if delta > 0:
                    made.setdefault(op, []).append(delta // grads[serial])
            else:
                held += delta
            event = next(events, None)
        curve.append(held)
    return curve, made


def _stretches(
    curve: list[int], made: dict[int, list[int]], marks: list[tuple[int, str]], span: range
) -> tuple[Stretch, ...]:
    """The stretches of ``span`` (ops), cut where a unit starts or ends."""
    inside = [(at, name) for at, name in marks if span.start <= at < span.stop]
    cuts = sorted({span.start, span.stop} | {at for at, _ in inside})
    out = []
    depth = 0
    for first, last in itertools.pairwise(cuts):
        depth += sum(1 if name == "start" else -1 for at, name in inside if at == first)
        new = [n for op in range(first + 1, last + 1) for n in made.get(op, [])]
        out.append(
            Stretch(
                unit=depth > 0,
                start=curve[first],
                peak=max(curve[first : last + 1]),
                grads=sum(new),
                largest_grad=max(new, default=0),
                moments=_moments(curve, made, first, last),
            )
        )
    return tuple(out)


def _moments(
    curve: list[int], made: dict[int, list[int]], first: int, last: int
) -> tuple[tuple[int, int], ...]:
    """Ops ``first`` to ``last`` cut where a gradient is made: the most activation bytes
    each part holds, and the gradient elements made by its start (see ``Stretch.moments``)."""
    moments: list[tuple[int, int]] = []
    held, done = curve[first], 0
    for op in range(first + 1, last + 1):
        if made.get(op):
            moments.append((held, done))
            held, done = curve[op], done + sum(made[op])
        held = max(held, curve[op])
    moments.append((held, done))
    return tuple(moments)


def traced_profile(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    *,
    precision: Precision = "fp32",
    activation_checkpointing: Checkpointing = None,
    batch: BatchBuilder | None = None,
    mixed: MixedPrecisionKind = "autocast",
    policy: UnitRule | UnitPolicy = "blocks",
) -> ActivationProfile:
    """Forward, loss and backward of ``model`` on fake tensors: what their activations hold.

    The arguments are those of :func:`fsdp_guide.memory.traced_activation_bytes`, and
    ``policy`` cuts backward into stretches at its units.

    Raises:
        PlanError: As :func:`~fsdp_guide.memory.traced_activation_bytes` does.

    Examples:
        >>> from fsdp_guide.models import TinyTransformer, TransformerConfig
        >>> model = TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2))
        >>> plain = traced_profile(model, 2, 32)
        >>> [s.unit for s in plain.stretches]  # the loss and head, two blocks, the embeddings
        [False, True, True, False]
        >>> again = traced_profile(model, 2, 32, activation_checkpointing="blocks")
        >>> again.saved < plain.saved, max(s.peak for s in again.stretches) > again.saved
        (True, True)
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_guide.models import loss_fn
    from fsdp_guide.wrap import saved_activation_bytes

    check_sizes(batch_size, seq_len)
    traced = _meta_copy(model)
    config = getattr(traced, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False  # training keeps no key/value cache
    try:
        units = _outer_units(traced, policy)  # found before checkpointing wraps them
    except ValueError as exc:
        raise PlanError(str(exc)) from exc
    make_batch = batch or _default_batch(traced)
    if activation_checkpointing is not None:
        _checkpoint(traced, activation_checkpointing)
    cast = precision == "mixed" and mixed == "params"
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if precision == "mixed" and not cast
        else nullcontext()
    )
    forward = [True]
    with FakeTensorMode(allow_non_fake_inputs=True), _quiet_tracer():
        _to_fake(traced, torch.bfloat16 if cast else None)
        params = list(traced.parameters())
        storages = _Storages({_ref(p.untyped_storage()).cdata for p in params})
        try:
            with _unit_marks(units, storages, forward), storages:
                inputs = _make_batch(make_batch, batch_size, seq_len)  # its storages count
                if cast:
                    x, *rest = inputs
                    x = pytree.tree_map_only(
                        Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, x
                    )
                    inputs = (x, *rest)
                with autocast, _OnRealData():
                    saved, loss = saved_activation_bytes(traced, lambda: loss_fn(traced, inputs))
                storages.release()
                backward_at = storages.ops
                forward[0] = False
                loss.backward()  # type: ignore[no-untyped-call]  # outside autocast, as trained
                storages.release()
        except PlanError:
            raise
        except RuntimeError as exc:
            raise PlanError(_cannot_trace(traced, exc)) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # The model refused the example batch (a missing or unexpected input).
            raise PlanError(
                f"cannot trace the forward pass of {type(model).__name__} on the example batch: "
                f"{type(exc).__name__}: {exc}; state its inputs with --input name:dtype[dims] "
                "(Python: batch=)"
            ) from exc
        grads = {
            serial: p.grad.element_size()
            for p in params
            if p.grad is not None and (serial := storages.serial_of(p.grad)) is not None
        }
    curve, made = _curve(storages, grads)
    return ActivationProfile(
        saved=saved,
        forward=_stretches(curve, made, storages.marks, range(0, backward_at)),
        stretches=_stretches(curve, made, storages.marks, range(backward_at, storages.ops)),
    )


#: Profiles already traced, by the caller's model or builder: planning one model for many
#: strategies traces it once per way of running it.
_TRACED: weakref.WeakKeyDictionary[Any, dict[Hashable, ActivationProfile]] = (
    weakref.WeakKeyDictionary()
)


def remembered(
    source: Any, key: Hashable, trace: Callable[[], ActivationProfile]
) -> ActivationProfile:
    """``trace()``, or what it returned before for ``source`` (the caller's model or builder,
    held weakly) and ``key``; traced every time for a source that takes no weak reference or
    a key that does not hash."""
    try:
        seen = _TRACED.setdefault(source, {})
        hash(key)
    except TypeError:
        return trace()
    if key not in seen:
        seen[key] = trace()
    return seen[key]
