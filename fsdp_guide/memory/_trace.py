"""Activations saved for backward, traced on fake tensors: no byte of the model allocated (private).

The model's real forward and loss run under :class:`torch._subclasses.fake_tensor.FakeTensorMode`:
tensors with shapes, dtypes and storages but no data. :func:`fsdp_guide.wrap.saved_activation_bytes`
counts what autograd keeps, each storage once, as on real tensors (fake storages are told apart
by identity, since they all sit at address 0). A builder runs under ``torch.device("meta")``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from fsdp_guide.errors import PlanError
from fsdp_guide.memory._zero import Precision

#: A model, or a function building one (called under ``torch.device("meta")``).
ModelSource = nn.Module | Callable[[], nn.Module]
#: What activation checkpointing to plan for: none, each :class:`~fsdp_guide.models.Block`,
#: or each module of a class.
Checkpointing = None | Literal["blocks"] | type[nn.Module]
#: How mixed precision computes in bf16: autocast (DDP's AMP) or bf16 parameters (FSDP, DeepSpeed).
MixedPrecisionKind = Literal["autocast", "params"]
#: Builds a ``(inputs, targets)`` batch of ``(batch_size, seq_len)``; run on fake tensors.
#: Inputs: a tensor, a tuple (positional) or a dict (keyword arguments); targets ``None``
#: when labels are among the inputs (:func:`fsdp_guide.inputs.example_batch`).
BatchBuilder = Callable[[int, int], tuple[Any, Tensor | None]]


_INT64_MAX = 2**63 - 1


def check_sizes(batch_size: object, seq_len: object) -> None:
    """Refuse sizes that are not counts, or whose product overflows a tensor's int64 size.

    Raises:
        PlanError: Naming the bad size.

    Examples:
        >>> check_sizes(2**40, 2**40)
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.PlanError: batch_size * seq_len = 1208925819614629174706176 overflows ...
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be an integer >= 1, got {value!r}")
    product = batch_size * seq_len  # type: ignore[operator]
    if product > _INT64_MAX:
        raise PlanError(f"batch_size * seq_len = {product} overflows int64")


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device, without copying a byte of its data."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("meta")
    return copy.deepcopy(model, memo)


def build_on_meta(source: ModelSource) -> nn.Module:
    """The model of ``source`` on the meta device: a copy of a model, or a builder's model.

    Raises:
        PlanError: When the builder raises or returns something else than a module.

    Examples:
        >>> build_on_meta(lambda: nn.Linear(2, 3)).weight.device
        device(type='meta')
    """
    if isinstance(source, nn.Module):
        return _meta_copy(source)
    if not callable(source):
        raise PlanError(f"model must be an nn.Module or a function building one, got {source!r}")
    try:
        with torch.device("meta"):
            model = source()
    except Exception as exc:  # the caller's code: say which builder failed and why
        raise PlanError(f"the model builder raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise PlanError(f"the model builder returned {type(model).__name__}, not an nn.Module")
    return model


def _to_fake(model: nn.Module, param_dtype: torch.dtype | None = None) -> None:
    """Replace ``model``'s parameters and buffers, in place, by CPU tensors of the active fake
    mode: same shapes and dtypes (floating parameters in ``param_dtype`` when given), tied
    parameters still tied."""
    fakes: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in fakes:
                    dtype = param_dtype if param_dtype and p.is_floating_point() else p.dtype
                    fake = torch.empty(p.shape, dtype=dtype, device="cpu")
                    fakes[id(p)] = nn.Parameter(fake, requires_grad=p.requires_grad)
                module._parameters[name] = fakes[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device="cpu")


def _default_batch(model: nn.Module) -> BatchBuilder:
    from fsdp_guide.inputs import example_batch

    return example_batch(model).build


#: Elements of a batch built with real values (a data loader's batch, a few MB at most);
#: a larger one is built on fake tensors, its data unknown.
REAL_BATCH_ELEMENTS = 2**24


class _OnRealData(TorchFunctionMode):
    """Run, on real tensors, what reads only the batch's data; everything else stays fake.

    A forward may branch on its inputs' values: transformers skips building an attention mask
    when the padding mask is all ones, and takes another path (a float mask, K/V repeated for
    every head) when it cannot look, as on fake tensors. Ops whose tensor arguments are all
    real (the batch and what is computed from it alone) are run for real, so the trace takes
    the branch the real forward takes.

    The same holds for what a forward makes from nothing but sizes: transformers builds
    ``position_ids = torch.arange(seq_len)`` when it is not given, and, without a cache
    (``use_cache=False``), reads them to tell packed sequences apart; on fake positions it
    cannot, and plans a materialised mask and repeated K/V heads that the real forward never
    makes. A factory call (no tensor argument) is therefore run for real too, when its result
    is small (up to :data:`REAL_BATCH_ELEMENTS`, known from a fake run first).
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        tensors = [
            t
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, Tensor) and not isinstance(t, nn.Parameter)
        ]
        if tensors and not any(isinstance(t, FakeTensor) or t.requires_grad for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if not tensors and _small_fakes(out):  # a factory: its values depend on no fake data
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return out


def _small_fakes(out: Any) -> bool:
    """Whether ``out`` is made of fake tensors only, and few elements in all."""
    from torch._subclasses.fake_tensor import FakeTensor

    leaves = pytree.tree_leaves(out)
    if not leaves or not all(isinstance(t, FakeTensor) for t in leaves):
        return False
    return sum(int(t.numel()) for t in leaves) <= REAL_BATCH_ELEMENTS


def _make_batch(make_batch: BatchBuilder, batch_size: int, seq_len: int) -> Any:
    """The batch, with real values when it is small enough (see :class:`_OnRealData`)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if batch_size * seq_len <= REAL_BATCH_ELEMENTS:
        with unset_fake_temporarily():
            inputs = make_batch(batch_size, seq_len)
        sizes = [t.numel() for t in pytree.tree_leaves(inputs) if isinstance(t, Tensor)]
        if sum(sizes) <= REAL_BATCH_ELEMENTS:
            return inputs
    return make_batch(batch_size, seq_len)


def _checkpoint(model: nn.Module, checkpointing: Checkpointing) -> None:
    from fsdp_guide.models import Block
    from fsdp_guide.wrap import checkpoint_layers

    layers = Block if checkpointing == "blocks" else checkpointing
    if not isinstance(layers, type) or not issubclass(layers, nn.Module):
        raise PlanError(
            f"activation_checkpointing must be None, 'blocks' or a Module class, "
            f"got {checkpointing!r}"
        )
    try:
        checkpoint_layers(model, layers)
    except ValueError as exc:
        raise PlanError(str(exc)) from exc


def traced_activation_bytes(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    *,
    precision: Precision = "fp32",
    activation_checkpointing: Checkpointing = None,
    batch: BatchBuilder | None = None,
    mixed: MixedPrecisionKind = "autocast",
) -> int:
    """Bytes autograd saves for backward in one forward and loss, traced on fake tensors.

    Args:
        model: The model, real or on the meta device; it is not changed.
        batch_size: Samples in this rank's batch.
        seq_len: Tokens per sample (ignored by models without sequences, such as the MLP).
        precision: ``"mixed"``: bfloat16 compute, as ``mixed`` says.
        activation_checkpointing: ``None``, ``"blocks"`` or a layer class to checkpoint.
        batch: Builds ``(inputs, targets)``; by default read from the model
            (:func:`fsdp_guide.inputs.example_batch`).
        mixed: How ``"mixed"`` computes in bfloat16. ``"autocast"``: under
            ``torch.autocast`` (DDP's AMP), which casts the weights for each op and keeps
            those bf16 copies for backward; ``"params"``: in bf16 parameters and inputs, as
            FSDP's ``MixedPrecision(param_dtype=torch.bfloat16)``, FSDP2's
            ``MixedPrecisionPolicy`` and DeepSpeed's ``bf16`` run it (their bf16 weights
            are parameters, not activations).

    Returns:
        What :func:`fsdp_guide.wrap.saved_activation_bytes` counts on a real forward.

    Raises:
        PlanError: For a model with no known batch, a sequence longer than the model takes,
            or sizes that overflow.

    Examples:
        >>> from fsdp_guide.models import TinyTransformer, TransformerConfig
        >>> model = TinyTransformer(TransformerConfig(n_layers=2, dim=32, n_heads=2))
        >>> traced_activation_bytes(model, 2, 32) > traced_activation_bytes(
        ...     model, 2, 32, activation_checkpointing="blocks")
        True
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_guide.models import loss_fn
    from fsdp_guide.wrap import saved_activation_bytes

    check_sizes(batch_size, seq_len)
    traced = _meta_copy(model)  # checkpointing and faking change it: never the caller's
    make_batch = batch or _default_batch(traced)
    if activation_checkpointing is not None:
        _checkpoint(traced, activation_checkpointing)
    if mixed not in ("autocast", "params"):
        raise PlanError(f"mixed must be 'autocast' or 'params', got {mixed!r}")
    cast = precision == "mixed" and mixed == "params"
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if precision == "mixed" and not cast
        else nullcontext()
    )
    # Real inputs meet fake parameters: the mode turns them into fake tensors where they do.
    with FakeTensorMode(allow_non_fake_inputs=True), _quiet_tracer():
        _to_fake(traced, torch.bfloat16 if cast else None)
        try:
            inputs = _make_batch(make_batch, batch_size, seq_len)
            if cast:  # the engine casts the forward's floating inputs, not the targets
                x, *rest = inputs
                x = pytree.tree_map_only(
                    Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, x
                )
                inputs = (x, *rest)
            with autocast, _OnRealData():
                nbytes, _ = saved_activation_bytes(traced, lambda: loss_fn(traced, inputs))
        except PlanError:
            raise
        except RuntimeError as exc:  # sizes past int64, data-dependent routing, ...
            raise PlanError(_cannot_trace(traced, exc)) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # The model refused the example batch (a missing or unexpected input).
            raise PlanError(
                f"cannot trace the forward pass of {type(model).__name__} on the example batch: "
                f"{type(exc).__name__}: {exc}; state its inputs with --input name:dtype[dims] "
                "(Python: batch=)"
            ) from exc
    return nbytes


@contextmanager
def _quiet_tracer() -> Iterator[None]:
    """The fake-tensor tracer logs a failing op's whole stack: the error says enough."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = disabled


def _cannot_trace(model: nn.Module, exc: Exception) -> str:
    """One line saying why the forward cannot be traced, and what to do instead."""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    experts = [m for m in model.modules() if "expert" in type(m).__name__.lower()]
    if experts:
        if "bf16" in reason.lower():  # transformers' grouped experts: a bf16-only fake kernel
            why = (
                "run a grouped matmul that traces on bf16 parameters only: plan FSDP, FSDP2 "
                "or DeepSpeed with precision='mixed' (on the command line, --precision mixed)"
            )
        else:
            why = (
                "send each token to experts chosen from its values, which a trace without "
                "data cannot follow"
            )
        return (
            f"cannot trace {type(model).__name__}'s activations: its mixture-of-experts layers "
            f"({type(experts[0]).__name__}) {why}; or measure one forward with "
            "saved_activation_bytes and pass its bytes as activations= (on the command line, "
            f"--activations) to plan the rest ({reason})"
        )
    return f"cannot trace the forward pass: {reason}"
