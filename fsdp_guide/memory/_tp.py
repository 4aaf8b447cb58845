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

transformers' own plans (a model's ``tp_plan``) add two styles: ``"colwise_gather_output"``
(the head: colwise, its output all-gathered to the whole vocabulary, so every rank holds the
whole logits) and ``"embedding_rowwise"`` (the token embedding: ``1 / t`` of the vocabulary's
rows each, its output all-reduced).
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


#: The styles a plan may give, and the layer each cuts.
STYLES: dict[str, type[nn.Module]] = {
    "colwise": nn.Linear,
    "rowwise": nn.Linear,
    "colwise_gather_output": nn.Linear,
    "embedding_rowwise": nn.Embedding,
}
_HOW = "give the layers to cut as tp_plan={'name or pattern': 'colwise' or 'rowwise', ...}"


def _cut_features(module: nn.Module, style: str) -> tuple[int, str]:
    """The features ``style`` cuts in ``module``, and what they are."""
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, "vocabulary rows"
    assert isinstance(module, nn.Linear)
    if style == "rowwise":
        return module.in_features, "input features"
    return module.out_features, "output features"


def cut_layers(model: nn.Module, tp: int, tp_plan: Styles) -> dict[str, str]:
    """The layers ``tp_plan`` cuts, name to style, checked to divide by ``tp``.

    Raises:
        PlanError: A style this planner does not cut (with how to give a plan), a named layer
            of another kind than its style cuts, a plan that matches nothing, features that
            do not divide by ``tp``.
    """
    bad = sorted({s for s in tp_plan.values() if s not in STYLES})
    if bad:
        raise PlanError(
            f"tp_plan styles must be {', '.join(STYLES)}; got {bad}: {_HOW} (on the command "
            "line, the model's own plan is read from its tp_plan attribute)"
        )
    cut: dict[str, str] = {}
    for name, module in model.named_modules():
        style = _style(name, tp_plan) if name else None
        if style is None:
            continue
        kind = STYLES[style]
        if not isinstance(module, kind):
            raise PlanError(
                f"tp_plan names {name!r}, a {type(module).__name__}: style {style!r} cuts an "
                f"nn.{kind.__name__}"
            )
        features, what = _cut_features(module, style)
        if features % tp:
            raise PlanError(
                f"{name} has {features} {what}, not divisible by tensor_parallel={tp}: "
                "choose a degree that divides them"
            )
        cut[name] = style
    if not cut:
        raise PlanError(f"tp_plan {dict(tp_plan)} matches no layer of {type(model).__name__}")
    return cut


def local_model(model: nn.Module, tp: int, cut: Mapping[str, str]) -> nn.Module:
    """A copy of ``model`` (on the meta device) whose cut layers have a rank's shapes; a
    ``"colwise_gather_output"`` layer returns its whole output, as its all-gather does."""
    local = copy.deepcopy(model)
    for name, style in cut.items():
        old = local.get_submodule(name)
        new: nn.Module
        if isinstance(old, nn.Embedding):
            new = nn.Embedding(old.num_embeddings // tp, old.embedding_dim, device="meta")
        else:
            assert isinstance(old, nn.Linear)
            inner, outer = old.in_features, old.out_features
            if style == "rowwise":
                inner //= tp
            else:
                outer //= tp
            new = nn.Linear(inner, outer, bias=old.bias is not None, device="meta")
            if style == "colwise_gather_output":
                new.register_forward_hook(lambda m, args, out: out.repeat_interleave(tp, -1))
        parent, _, leaf = name.rpartition(".")
        setattr(local.get_submodule(parent) if parent else local, leaf, new)
    return local


def tp_elements(
    model: nn.Module, cut: Mapping[str, str], batch_size: int, seq_len: int
) -> dict[str, int]:
    """Elements sent over ``tp`` per step, by kind: rowwise outputs and the cut embedding's
    all-reduced in forward, colwise input gradients in backward, a gathered output
    all-gathered, for ``batch_size`` samples of ``seq_len`` tokens.

    Examples:
        >>> mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
        >>> tp_elements(mlp, {"0": "colwise", "1": "rowwise"}, 2, 3)
        {'all_reduce': 48}
        >>> tp_elements(mlp, {"1": "colwise_gather_output"}, 2, 3)  # 6 x 8 in, 6 x 4 out
        {'all_reduce': 48, 'all_gather': 24}
    """
    out: dict[str, int] = {}
    tokens = batch_size * seq_len
    for name, style in cut.items():
        layer = model.get_submodule(name)
        if isinstance(layer, nn.Embedding):
            out["all_reduce"] = out.get("all_reduce", 0) + tokens * layer.embedding_dim
            continue
        assert isinstance(layer, nn.Linear)
        features = layer.out_features if style == "rowwise" else layer.in_features
        out["all_reduce"] = out.get("all_reduce", 0) + tokens * features
        if style == "colwise_gather_output":
            out["all_gather"] = out.get("all_gather", 0) + tokens * layer.out_features
    return out


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
