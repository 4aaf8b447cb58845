"""Frozen parameters and tied weights in a plan (private).

**Frozen parameters** (fine-tuning a few layers, LoRA adapters) have no gradient and no
optimizer state: only the trainable ones cost 2 + 12 bytes more than their weights. FSDP2
shards each parameter on its own, so a frozen one is a sharded weight and nothing else; DDP
puts only the trainable ones in its buckets and all-reduces them. FSDP1 keeps one gradient
per flat parameter, frozen parts included (``use_orig_params=True``), and refuses a flat
parameter that mixes both without it: its plans with frozen parameters are refused here.
Which parameters train is the model's own ``requires_grad`` (a ``peft`` model built by the
builder freezes its base), or ``plan(..., trainable=...)``: parameter-name patterns
(``fnmatch``) or a function of the name.

**Tied weights** (an embedding that is also the output head) are one parameter used by two
modules. FSDP2 refuses to put it in two units; the two ways out are one unit for both modules
(``fully_shard([embed, head])``) or both left to the root. A plan whose units split a tied
parameter is refused the same way, before anything is traced.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import replace

from torch import nn

from fsdp_guide.engines import Engine, UnitPolicy, UnitRule, unit_names
from fsdp_guide.errors import PlanError
from fsdp_guide.memory._state import ModelState

#: Which parameters train: name patterns (``fnmatch``) or a function of the name.
TrainableRule = Sequence[str] | Callable[[str], bool]
#: Engines whose plans with frozen parameters are exact.
_FROZEN_ENGINES = ("ddp", "fsdp2")


def apply_trainable(model: nn.Module, trainable: TrainableRule | None) -> tuple[int, int]:
    """Set ``requires_grad`` of ``model`` (on meta) by ``trainable``; (trainable, frozen) counts.

    ``None`` keeps the model's own flags.

    Raises:
        PlanError: A rule of the wrong type, or no parameter left to train.

    Examples:
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
        >>> apply_trainable(model, ["1.*"]), model[0].weight.requires_grad
        ((4, 9), False)
        >>> apply_trainable(model, ["2.*"])
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.PlanError: trainable=['2.*'] matches no parameter of Sequential ...
    """
    if trainable is not None:
        if isinstance(trainable, str) or not (
            callable(trainable)
            or (isinstance(trainable, Sequence) and all(isinstance(t, str) for t in trainable))
        ):
            raise PlanError(
                "trainable must be a list of parameter-name patterns or a function of the "
                f"name, got {trainable!r}"
            )
        for name, p in model.named_parameters():
            if callable(trainable):
                keep = bool(trainable(name))
            else:
                keep = any(fnmatch.fnmatchcase(name, pattern) for pattern in trainable)
            p.requires_grad_(keep)
    counts = [0, 0]
    for p in model.parameters():
        counts[0 if p.requires_grad else 1] += p.numel()
    if not counts[0]:
        names = ", ".join(n for n, _ in list(model.named_parameters())[:3])
        given = "" if trainable is None else f"trainable={trainable!r} "
        raise PlanError(
            f"{given}matches no parameter of {type(model).__name__} (its parameters: "
            f"{names}, ...): nothing would train"
        )
    return counts[0], counts[1]


def check_frozen(engine: Engine, frozen: int) -> None:
    """Refuse frozen parameters under an engine whose plan of them is not exact."""
    if frozen and engine.name not in _FROZEN_ENGINES:
        raise PlanError(
            f"frozen parameters are planned for {' and '.join(_FROZEN_ENGINES)}, not "
            f"{engine.name} (FSDP1 keeps a gradient for each whole flat parameter, frozen "
            "parts included); plan with strategy='fsdp2', or with every parameter trainable"
        )


def check_tied(model: nn.Module, policy: UnitRule | UnitPolicy) -> None:
    """Refuse units that split a parameter shared by two modules, as ``fully_shard`` does.

    Examples:
        >>> from fsdp_guide.models import TinyTransformer, TransformerConfig
        >>> model = TinyTransformer(TransformerConfig(n_layers=1, dim=8, n_heads=2))
        >>> model.head.weight = model.tok_emb.weight
        >>> check_tied(model, "blocks")  # the embedding and head both in the root: fine
        >>> class EmbeddingApart:
        ...     def select(self, model):
        ...         return ["tok_emb"]
        >>> check_tied(model, EmbeddingApart())
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.PlanError: tok_emb.weight is tied: used by tok_emb (unit tok_emb), ...
    """
    try:
        names = unit_names(model, policy)
    except ValueError:
        return  # the plan names the bad policy itself
    users: dict[int, list[tuple[str, str]]] = {}
    first: dict[int, str] = {}
    for module_name, module in model.named_modules():
        unit = next((u for u in names if _inside(module_name, u)), "")
        for param_name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            first.setdefault(id(p), full)
            users.setdefault(id(p), []).append((module_name or "the root", unit or "root"))
    for key, used in users.items():
        units = {unit for _, unit in used}
        if len(units) > 1:
            where = ", ".join(f"{m} (unit {u})" for m, u in used)
            raise PlanError(
                f"{first[key]} is tied: used by {where}; FSDP2 refuses a parameter in two "
                "units. Put both modules in one unit (fully_shard([a, b])) or leave both to "
                "the root"
            )


def _inside(module_name: str, unit: str) -> bool:
    """Whether the module is in the unit ``unit`` (modules joined by ``+`` are one unit)."""
    return any(module_name == m or module_name.startswith(m + ".") for m in unit.split("+"))


def with_frozen(
    every: tuple[ModelState, ...], trainable: tuple[ModelState, ...]
) -> tuple[ModelState, ...]:
    """Each rank's state: the parameters of every tensor, the rest of the trainable ones.

    Examples:
        >>> a = ModelState(params=100, grads=100, optimizer=200)
        >>> t = ModelState(params=10, grads=10, optimizer=24)
        >>> with_frozen((a,), (t,))
        (ModelState(params=100, grads=10, optimizer=24, total=134),)
    """
    return tuple(replace(t, params=a.params) for a, t in zip(every, trainable, strict=True))
