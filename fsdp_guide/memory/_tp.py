"""What tensor parallelism leaves on each rank of a ``(dp, tp)`` mesh (private).

A tensor-parallel degree ``t`` cuts the layers a plan names: a ``"colwise"`` linear layer
keeps ``1 / t`` of its output features (weight rows and bias), a ``"rowwise"`` one ``1 / t``
of its input features (weight columns; the bias stays whole). Every other parameter is
replicated over the ``tp`` dimension. FSDP2 on the ``dp`` dimension then shards what is left,
so a rank's state is the FSDP2 layout of these *local* shapes over ``dp`` ranks.

Activations are traced on a local copy of the model, its cut layers replaced by the smaller
linear layers a rank computes with (a model whose forward infers head counts and widths from
its tensors, as :class:`fsdp_guide.parallel.ParallelTransformer` does, traces unchanged).

Communication: a rowwise layer's output is all-reduced in forward, a colwise layer's input
gradient in backward (``t`` ranks each); for ``b`` samples of ``s`` tokens per rank, that is
``b · s`` times the layer's output features (rowwise) or input features (colwise).
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Mapping

from torch import nn

from fsdp_guide.engines import Engine
from fsdp_guide.errors import PlanError

Styles = Mapping[str, str]


def _style(name: str, tp_plan: Styles) -> str | None:
    """The style of the layer called ``name`` (``blocks.0.attention.wq``) under ``tp_plan``,
    whose keys name a layer inside a block (``attention.wq``) or match it with ``fnmatch``."""
    for pattern, style in tp_plan.items():
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}"):
            return style
    return None


def cut_layers(model: nn.Module, tp: int, tp_plan: Styles) -> dict[str, str]:
    """The linear layers ``tp_plan`` cuts, name to style, checked to divide by ``tp``.

    Raises:
        PlanError: A style other than colwise/rowwise, a named layer that is not
            ``nn.Linear``, a plan that matches nothing, features that do not divide by ``tp``.
    """
    bad = sorted({s for s in tp_plan.values() if s not in ("colwise", "rowwise")})
    if bad:
        raise PlanError(f"tp_plan styles must be 'colwise' or 'rowwise', got {bad}")
    cut: dict[str, str] = {}
    for name, module in model.named_modules():
        style = _style(name, tp_plan) if name else None
        if style is None:
            continue
        if not isinstance(module, nn.Linear):
            raise PlanError(f"tp_plan names {name!r}, a {type(module).__name__}: name nn.Linear")
        features = module.out_features if style == "colwise" else module.in_features
        if features % tp:
            raise PlanError(
                f"{name} has {features} {'output' if style == 'colwise' else 'input'} features, "
                f"not divisible by tensor_parallel={tp}: choose a degree that divides them"
            )
        cut[name] = style
    if not cut:
        raise PlanError(f"tp_plan {dict(tp_plan)} matches no layer of {type(model).__name__}")
    return cut


def local_model(model: nn.Module, tp: int, cut: Mapping[str, str]) -> nn.Module:
    """A copy of ``model`` (on the meta device) whose cut layers have a rank's shapes."""
    local = copy.deepcopy(model)
    for name, style in cut.items():
        old = local.get_submodule(name)
        assert isinstance(old, nn.Linear)
        inner, outer = old.in_features, old.out_features
        if style == "colwise":
            outer //= tp
        else:
            inner //= tp
        new = nn.Linear(inner, outer, bias=old.bias is not None, device="meta")
        parent, _, leaf = name.rpartition(".")
        setattr(local.get_submodule(parent) if parent else local, leaf, new)
    return local


def tp_all_reduce_elements(
    model: nn.Module, cut: Mapping[str, str], batch_size: int, seq_len: int
) -> int:
    """Elements all-reduced over ``tp`` per step: rowwise outputs in forward, colwise input
    gradients in backward, for ``batch_size`` samples of ``seq_len`` tokens.

    Examples:
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
        >>> tp_all_reduce_elements(mlp, {"0": "colwise", "1": "rowwise"}, 2, 3)
        48
    """
    total = 0
    for name, style in cut.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, nn.Linear)
        features = layer.out_features if style == "rowwise" else layer.in_features
        total += batch_size * seq_len * features
    return total


def check_tp(engine: Engine, world_size: int, tensor_parallel: int) -> int:
    """``tensor_parallel``, checked: an int dividing the ranks, with plain FSDP2 on ``dp``."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int):
        raise PlanError(f"tensor_parallel must be an int >= 1, got {tensor_parallel!r}")
    if tensor_parallel < 1 or world_size % tensor_parallel:
        raise PlanError(
            f"tensor_parallel={tensor_parallel} must be >= 1 and divide world_size={world_size}"
        )
    dp = world_size // tensor_parallel
    # FSDP2 over the whole data-parallel dimension: no all-reduce of its own (HSDP has one).
    hybrid = "all_reduce" in engine.collectives(dp, dp).payload
    if tensor_parallel > 1 and (engine.name != "fsdp2" or hybrid):
        raise PlanError(
            "tensor parallelism is planned with strategy='fsdp2' on the other mesh "
            f"dimension, not {engine.name!r}"
        )
    return tensor_parallel


def tp_plan_of(model: nn.Module, tp_plan: Mapping[str, str] | None) -> Mapping[str, str]:
    """``tp_plan``, or the model's own ``tp_plan`` attribute."""
    found = tp_plan if tp_plan is not None else getattr(model, "tp_plan", None)
    if not isinstance(found, Mapping) or not found:
        raise PlanError(
            f"{type(model).__name__} has no tp_plan: pass tp_plan={{'layer': 'colwise', ...}}"
        )
    return found
