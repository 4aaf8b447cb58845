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

from torch import Tensor, nn

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


def tp_plan_of(model: nn.Module, tp_plan: Mapping[str, str] | None) -> Mapping[str, str]:
    """``tp_plan``, or the model's own ``tp_plan`` attribute."""
    found = tp_plan if tp_plan is not None else getattr(model, "tp_plan", None)
    if not isinstance(found, Mapping) or not found:
        raise PlanError(
            f"{type(model).__name__} has no tp_plan: pass tp_plan={{'layer': 'colwise', ...}}"
        )
    return found


#: The norms sequence parallelism runs on a rank's tokens, with replicated weights.
NORMS = (nn.LayerNorm, nn.RMSNorm)


def _gathered(model: nn.Module, cut: Mapping[str, str]) -> dict[str, int]:
    """The modules whose input sequence parallelism all-gathers once (the parents of the
    colwise layers: ``blocks.0.attention``), name to input features."""
    gathered: dict[str, int] = {}
    for name, style in cut.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, nn.Linear)
        if style == "colwise":
            gathered.setdefault(name.rpartition(".")[0], layer.in_features)
    return gathered


def _width(model: nn.Module, cut: Mapping[str, str]) -> int:
    """The residual stream's features: what every rowwise layer returns to."""
    widths = {
        layer.out_features
        for name, style in cut.items()
        if style == "rowwise" and isinstance(layer := model.get_submodule(name), nn.Linear)
    }
    if len(widths) != 1:
        raise PlanError(
            f"sequence parallelism needs rowwise layers that all return the residual stream's "
            f"width, got out_features {sorted(widths)}"
        )
    return widths.pop()


def sp_elements(
    model: nn.Module, cut: Mapping[str, str], batch_size: int, seq_len: int
) -> dict[str, int]:
    """Elements sent over ``tp`` per step with sequence parallelism, per collective kind.

    Counted as the whole ``batch_size x seq_len`` tensor, as ``count_collectives`` counts
    them (a reduce-scatter's input, an all-gather's output):

    - ``all_gather``: in forward, each colwise layers' parent module's input (once, shared by
      its colwise layers) and the head's input; in backward, the gradient of each rowwise
      layer's output and that of the first block's input (the replicated embeddings need it
      all).
    - ``reduce_scatter``: in forward, each rowwise layer's output (where plain tensor
      parallelism all-reduces it); in backward, the gradient of each gathered input.
    - ``all_reduce``: the gradients of the norms' replicated weights, each rank's being the
      sum over its tokens only.

    Examples:
        >>> from fsdp_guide.parallel import TP_PLAN, ParallelConfig, ParallelTransformer
        >>> model = ParallelTransformer(ParallelConfig(n_layers=1, dim=8, n_heads=2, hidden=16))
        >>> cut = cut_layers(model, 2, TP_PLAN)
        >>> sp_elements(model, cut, batch_size=1, seq_len=4)  # 32 = 1 x 4 tokens x dim 8
        {'all_gather': 192, 'reduce_scatter': 128, 'all_reduce': 48}
    """
    tokens = batch_size * seq_len
    gathered = sum(_gathered(model, cut).values())
    rowwise = 0
    for name, style in cut.items():
        layer = model.get_submodule(name)
        if style == "rowwise" and isinstance(layer, nn.Linear):
            rowwise += layer.out_features
    norms = sum(p.numel() for m in model.modules() if isinstance(m, NORMS) for p in m.parameters())
    width = _width(model, cut)
    return {
        "all_gather": tokens * (gathered + rowwise + 2 * width),
        "reduce_scatter": tokens * (rowwise + gathered),
        "all_reduce": norms,
    }


def sequence_parallel_model(local: nn.Module, tp: int, cut: Mapping[str, str]) -> nn.Module:
    """``local`` (a rank's cut model) with hooks that give it a rank's sequence-parallel
    shapes: the first block takes ``1 / tp`` of the tokens, each gathered module and the head
    receive ``tp`` times its tokens, each rowwise layer returns ``1 / tp`` of them.

    The gathered tensors are new storages, as the all-gathers' outputs are; their values do
    not matter, only what autograd saves of them (traced on fake tensors).

    Raises:
        PlanError: For a model with no ``blocks`` or no ``head`` to hook.
    """
    blocks, head = getattr(local, "blocks", None), getattr(local, "head", None)
    if not isinstance(blocks, nn.ModuleList) or not len(blocks) or not isinstance(head, nn.Module):
        raise PlanError(
            f"sequence parallelism is planned on a model with `blocks` (a ModuleList) and a "
            f"`head`, as fsdp_guide.parallel.parallelize lays it out; "
            f"{type(local).__name__} has not both"
        )

    def gather(module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return (args[0].repeat(1, tp, 1), *args[1:])

    def first_tokens(module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        # What DTensor's Replicate -> Shard(1) keeps: a contiguous chunk.
        x = args[0]
        return (x.narrow(1, 0, x.shape[1] // tp).contiguous(), *args[1:])

    def scatter(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> Tensor:
        return out.narrow(1, 0, out.shape[1] // tp).clone()  # a reduce-scatter's own output

    blocks[0].register_forward_pre_hook(first_tokens)
    for name in _gathered(local, cut):
        local.get_submodule(name).register_forward_pre_hook(gather)
    for name, style in cut.items():
        if style == "rowwise":
            local.get_submodule(name).register_forward_hook(scatter)
    head.register_forward_pre_hook(gather)
    return local
