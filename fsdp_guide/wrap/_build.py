"""Build a model sharded from the start, never whole on any rank: :func:`build_sharded`.

``shard(builder(), ...)`` makes every rank build the whole model first: each rank holds
``Ψ`` parameters for a moment, which is what does not fit. PyTorch's recipe for FSDP2 is to
build on the meta device, ``fully_shard``, ``to_empty`` and re-initialise; but
``reset_parameters`` on a sharded parameter initialises each shard on its own, so the
weights differ from the unsharded model's (on CPU, with a different random stream per
shard). :func:`build_sharded` keeps the memory of the recipe and the weights of the plain
model: it allocates and initialises one unit at a time, whole, in the order the
constructor made them, and shards the unit before going on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from fsdp_guide.engines import FSDP2
from fsdp_guide.errors import MetaInitError
from fsdp_guide.wrap._policy import WrapPolicy, selected_modules
from fsdp_guide.wrap._shard import check_process_group

Init = Literal["reset", "empty"]


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def uninitialisable_modules(model: nn.Module) -> list[str]:
    """Names of the submodules with tensors of their own but no ``reset_parameters()``.

    After ``to_empty`` their tensors hold whatever was in memory: nothing can initialise
    them again but loading weights.

    Examples:
        >>> class Scale(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.gain = nn.Parameter(torch.ones(4))
        >>> uninitialisable_modules(nn.Sequential(nn.Linear(4, 4), Scale()))
        ['1 (Scale)']
    """
    return [
        f"{name or '(root)'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if _own_tensors(m) and not callable(getattr(m, "reset_parameters", None))
    ]


def _check_buildable(model: nn.Module, init: Init) -> None:
    everyone = list(model.named_parameters(remove_duplicate=False))
    shared = len(everyone) - len(list(model.parameters()))
    if shared:
        raise MetaInitError(
            f"{type(model).__name__} shares {shared} parameter(s) between modules (tied "
            "weights); build_sharded materialises each module's own tensors and would "
            "untie them. Build it whole, or tie the weights after building"
        )
    missing = uninitialisable_modules(model) if init == "reset" else []
    if missing:
        raise MetaInitError(
            f"these modules have parameters or buffers but no reset_parameters(), so "
            f"nothing could initialise them after building on the meta device: "
            f"{', '.join(missing)}. Give them a reset_parameters(), or pass init='empty' "
            "and load every weight afterwards (fsdp_guide.checkpoint.load_full_state_dict)"
        )


def build_sharded(
    builder: Callable[[], nn.Module],
    policy: WrapPolicy | None = None,
    *,
    init: Init = "reset",
    seed: int | None = None,
    device: torch.device | str | None = None,
    init_device: torch.device | str = "cpu",
    **fully_shard_options: Any,
) -> nn.Module:
    """Build ``builder()`` sharded with FSDP2 without ever holding the whole model on a rank.

    The model is built on the meta device (no memory). Then, walking the modules in the
    order the constructor registered them, each module's own tensors are allocated whole
    and initialised by its ``reset_parameters()``; as soon as a unit chosen by ``policy`` is
    complete it is moved to ``device`` and sharded with ``fully_shard``, freeing the whole
    copy; the root is sharded last. A rank holds at most its shards, one whole unit and the
    root's own parameters (embeddings, head) at once.

    With ``init="reset"`` the weights equal those of ``builder()`` run after
    ``torch.manual_seed(seed)`` (or from the current random state), when the constructor
    initialises each module by its ``reset_parameters()`` (torch's layers do) and draws
    nothing else from the random generator. They are drawn on ``init_device``, the CPU by
    default, so a GPU run starts from the same weights as a CPU run. With ``init="empty"``
    the tensors are left uninitialised, to be loaded from a checkpoint.

    Call it on every rank, inside a function run by :func:`fsdp_guide.launch`.

    Args:
        builder: Builds the model (called once, under ``torch.device("meta")``).
        policy: Which submodules become units (``LayerPolicy(Block)``); ``None``: only the
            root, which then is whole on each rank for a moment.
        init: ``"reset"`` (each module's ``reset_parameters()``) or ``"empty"``.
        seed: Seed of the initialisation; ``None`` draws from the current random state.
            The caller's random state is left as it was either way.
        device: Where the shards live; :func:`~fsdp_guide.launcher.rank_device` by default.
        init_device: Where each unit is allocated and initialised before it moves to
            ``device`` and is sharded.
        **fully_shard_options: Passed to ``fully_shard`` (``mesh``, ``reshard_after_forward``,
            ``mp_policy``, ...).

    Returns:
        The model, sharded in place; build the optimizer from it afterwards.

    Raises:
        ValueError: ``MetaInitError``: Before anything is allocated: tied weights, or
            (``init="reset"``) a module with tensors of its own and no ``reset_parameters()``.
        ValueError: ``init`` is neither ``"reset"`` nor ``"empty"``.
        RuntimeError: No process group is initialised.

    Examples:
        >>> build_sharded(lambda: nn.Linear(2, 2), init="random")
        Traceback (most recent call last):
        ...
        ValueError: init must be 'reset' or 'empty', got 'random'

        On one rank in this process: the weights equal the plain model's.

        >>> import torch.distributed as dist
        >>> from fsdp_guide.launcher import dist_init, find_free_port
        >>> from fsdp_guide.models import Block, TinyTransformer, TransformerConfig
        >>> from fsdp_guide.wrap import LayerPolicy
        >>> dist_init(0, 1, backend="gloo", master_port=find_free_port())
        >>> config = TransformerConfig(n_layers=2, dim=32, n_heads=2)
        >>> model = build_sharded(lambda: TinyTransformer(config), LayerPolicy(Block), seed=0)
        >>> _ = torch.manual_seed(0)
        >>> plain = TinyTransformer(config)
        >>> pairs = zip(model.parameters(), plain.parameters(), strict=True)
        >>> all(torch.equal(p.full_tensor(), q) for p, q in pairs)
        True
        >>> dist.destroy_process_group()
    """
    if init not in ("reset", "empty"):
        raise ValueError(f"init must be 'reset' or 'empty', got {init!r}")
    with torch.device("meta"):
        model = builder()
    _check_buildable(model, init)
    check_process_group("build_sharded()")
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from fsdp_guide.launcher import rank_device

    options = dict(fully_shard_options)
    if options.get("mesh") is None:  # every rank, as shard(engine="fsdp2") does
        options["mesh"] = FSDP2().mesh(rank_device(), dist.get_world_size())
    target = torch.device(device) if device is not None else rank_device()
    staging = torch.device(init_device)
    units = {id(m) for _, m in selected_modules(model, policy)} if policy is not None else set()
    done: set[int] = set()

    def materialise(module: nn.Module) -> None:
        if id(module) in done:  # a module reached twice (shared) is built once
            return
        done.add(id(module))
        if any(t.is_meta for t in _own_tensors(module)):
            module.to_empty(device=staging, recurse=False)
            if init == "reset":
                getattr(module, "reset_parameters")()  # noqa: B009 - checked callable above
        for child in module.children():  # registration order: the constructor's
            materialise(child)
        if id(module) in units or module is model:
            module.to(target)  # the whole unit, then its shards only
            fully_shard(module, **options)

    with torch.random.fork_rng(devices=[staging] if staging.type == "cuda" else []):
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            materialise(model)
    return model
