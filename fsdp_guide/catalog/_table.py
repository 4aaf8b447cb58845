"""The table of strategies and the lookups every part of the package uses (private).

Nothing here imports FairScale, Lightning or the memory formulas at import time: the table is
read by the CLI's argument checks, which must answer before any heavy import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from fsdp_guide.catalog import _setup as setup
from fsdp_guide.catalog._setup import SetupContext, Wrapped

if TYPE_CHECKING:
    from torch import nn

    from fsdp_guide.memory._state import ModelState

#: The mechanism a strategy is built on; checkpoints and memory counting dispatch on it.
Engine = Literal[
    "ddp", "zero", "oss", "sharded_ddp", "fsdp1", "fsdp2", "fairscale_fsdp", "deepspeed"
]
#: What a strategy needs beyond torch on CPU.
Requirement = Literal["cuda", "fairscale", "deepspeed"]


@dataclass(frozen=True)
class StrategySpec:
    """One way to train data-parallel: its name, its ZeRO stage, what it needs.

    Attributes:
        name: The one name used everywhere: the CLI, :func:`fsdp_guide.compare.run_comparison`,
            :func:`fsdp_guide.checkpoint.detect_strategy`, the ZeRO formulas.
        summary: What it is, in a few words.
        engine: The wrapper or optimizer it is built on; several strategies share one (the
            four FSDP1 sharding strategies are all ``"fsdp1"``).
        zero_stage: Its ZeRO stage in the textbook sense.
        stage_at_step: The stage whose formula describes the state held after
            ``optimizer.step()``; differs from ``zero_stage`` for FSDP1's ``SHARD_GRAD_OP``
            (ZeRO-2 in forward/backward, but it reshards after backward).
        needs: What it needs beyond torch on CPU: ``"cuda"``, ``"fairscale"``, ``"deepspeed"``
            (the optional extra, checked by :func:`check_strategies` before any rank starts).
        full_grads: Whether every rank keeps a full-size gradient buffer (ShardedDDP with
            its reduce buckets), see :func:`fsdp_guide.memory.estimate_model_state`.
        hybrid: Whether the state is sharded within groups of two ranks and replicated
            across groups (FSDP1 ``HYBRID_SHARD``).
        offload: What it keeps in host memory instead of on the device between uses:
            ``("optimizer",)`` (the optimizer state and its step), ``("optimizer",
            "params")``; empty for the others.
        aliases: Other spellings accepted for it (older names of this project).
        setup: Wraps a model and builds its Adam optimizer inside a launched rank; called by
            :func:`fsdp_guide.catalog.wrap_for_strategy`.
    """

    name: str
    summary: str
    engine: Engine
    zero_stage: int
    stage_at_step: int
    needs: frozenset[Requirement] = field(default_factory=frozenset)
    full_grads: bool = False
    hybrid: bool = False
    offload: tuple[Literal["optimizer", "params"], ...] = ()
    aliases: tuple[str, ...] = ()
    setup: Callable[[nn.Module, SetupContext], Wrapped] = field(
        kw_only=True, repr=False, compare=False
    )

    @property
    def needs_cuda(self) -> bool:
        """Whether it only runs on GPUs (FairScale FSDP)."""
        return "cuda" in self.needs

    def shard_group_size(self, world_size: int) -> int:
        """Ranks the state is sharded over.

        Examples:
            >>> STRATEGIES["fsdp_hybrid"].shard_group_size(4)
            2
            >>> STRATEGIES["fsdp"].shard_group_size(4)
            4
        """
        if self.hybrid and world_size % 2 == 0:
            return 2
        return world_size

    def predict(
        self, num_params: int, world_size: int, param_numels: Sequence[int] | None = None
    ) -> ModelState:
        """The fp32 Adam prediction for the state held after ``optimizer.step()``.

        The ZeRO formulas (:func:`~fsdp_guide.memory.estimate_model_state`), except for
        DeepSpeed, whose layout (a separate fp32 master copy, padded partitions, ZeRO-3's
        gradient buffer and reduce bucket) has its own formula,
        :func:`~fsdp_guide.memory.estimate_deepspeed_state`, with the buckets of
        :func:`~fsdp_guide.deepspeed.zero_config`.

        Args:
            num_params: Parameters of the model.
            world_size: Number of ranks.
            param_numels: The size of each parameter tensor; DeepSpeed's ZeRO-3 pads each
                one to a multiple of ``world_size`` (none or empty: one tensor of ``num_params``).

        Examples:
            >>> STRATEGIES["oss"].predict(1000, 2)
            ModelState(params=4000, grads=4000, optimizer=4000, total=12000)
            >>> STRATEGIES["deepspeed_zero2"].predict(1000, 2)
            ModelState(params=4000, master=2000, grads=0, optimizer=4004, total=10004)
        """
        if self.engine == "deepspeed":
            from fsdp_guide.deepspeed._config import BUCKET_ELEMENTS
            from fsdp_guide.memory._deepspeed import estimate_deepspeed_state

            return estimate_deepspeed_state(
                list(param_numels) if param_numels else num_params,
                world_size,
                self.zero_stage,
                reduce_bucket_size=BUCKET_ELEMENTS,
                offload_optimizer="optimizer" in self.offload,
                offload_param="params" in self.offload,
            )
        from fsdp_guide.memory._zero import estimate_model_state

        return estimate_model_state(
            num_params,
            self.shard_group_size(world_size),
            self.stage_at_step,
            "fp32",
            "adam",
            full_grads=self.full_grads,
        )


_FAIRSCALE: frozenset[Requirement] = frozenset({"fairscale"})
_DEEPSPEED: frozenset[Requirement] = frozenset({"deepspeed"})

#: Every strategy, by name, in the order of the ZeRO stages.
STRATEGIES: dict[str, StrategySpec] = {
    spec.name: spec
    for spec in (
        StrategySpec(
            "ddp", "PyTorch DDP, gradients as bucket views", "ddp", 0, 0, setup=setup.setup_ddp
        ),
        StrategySpec(
            "zero1",
            "DDP + torch ZeroRedundancyOptimizer",
            "zero",
            1,
            1,
            aliases=("zero",),
            setup=setup.setup_zero1,
        ),
        StrategySpec(
            "oss",
            "DDP + FairScale OSS (sharded optimizer)",
            "oss",
            1,
            1,
            _FAIRSCALE,
            setup=setup.setup_oss,
        ),
        StrategySpec(
            "sharded_ddp",
            "FairScale OSS + ShardedDDP, reduce_buffer_size=0",
            "sharded_ddp",
            2,
            2,
            _FAIRSCALE,
            setup=setup.setup_sharded_ddp,
        ),
        StrategySpec(
            "sharded_ddp_buckets",
            "FairScale OSS + ShardedDDP, default reduce buckets",
            "sharded_ddp",
            2,
            2,
            _FAIRSCALE,
            full_grads=True,
            setup=setup.setup_sharded_ddp_buckets,
        ),
        StrategySpec(
            "fsdp",
            "PyTorch FSDP1, FULL_SHARD",
            "fsdp1",
            3,
            3,
            aliases=("fsdp1",),
            setup=setup.setup_fsdp,
        ),
        StrategySpec(
            "fsdp_grad_op",
            "PyTorch FSDP1, SHARD_GRAD_OP",
            "fsdp1",
            2,
            3,
            setup=setup.setup_fsdp_grad_op,
        ),
        StrategySpec(
            "fsdp_no_shard",
            "PyTorch FSDP1, NO_SHARD",
            "fsdp1",
            0,
            0,
            setup=setup.setup_fsdp_no_shard,
        ),
        StrategySpec(
            "fsdp_hybrid",
            "PyTorch FSDP1, HYBRID_SHARD in pairs",
            "fsdp1",
            3,
            3,
            hybrid=True,
            setup=setup.setup_fsdp_hybrid,
        ),
        StrategySpec(
            "fsdp2", "PyTorch FSDP2, fully_shard per block", "fsdp2", 3, 3, setup=setup.setup_fsdp2
        ),
        StrategySpec(
            "fairscale_fsdp",
            "FairScale FSDP (CUDA)",
            "fairscale_fsdp",
            3,
            3,
            frozenset({"cuda", "fairscale"}),
            setup=setup.setup_fairscale_fsdp,
        ),
        StrategySpec(
            "deepspeed_zero1",
            "DeepSpeed ZeRO-1, torch Adam",
            "deepspeed",
            1,
            1,
            _DEEPSPEED,
            setup=setup.setup_deepspeed_zero1,
        ),
        StrategySpec(
            "deepspeed_zero2",
            "DeepSpeed ZeRO-2, torch Adam",
            "deepspeed",
            2,
            2,
            _DEEPSPEED,
            setup=setup.setup_deepspeed_zero2,
        ),
        StrategySpec(
            "deepspeed_zero2_offload",
            "DeepSpeed ZeRO-2, optimizer offloaded to CPU",
            "deepspeed",
            2,
            2,
            _DEEPSPEED,
            offload=("optimizer",),
            setup=setup.setup_deepspeed_zero2_offload,
        ),
        StrategySpec(
            "deepspeed_zero3",
            "DeepSpeed ZeRO-3, torch Adam",
            "deepspeed",
            3,
            3,
            _DEEPSPEED,
            setup=setup.setup_deepspeed_zero3,
        ),
        StrategySpec(
            "deepspeed_zero3_offload",
            "DeepSpeed ZeRO-3, optimizer and parameters offloaded to CPU",
            "deepspeed",
            3,
            3,
            _DEEPSPEED,
            offload=("optimizer", "params"),
            setup=setup.setup_deepspeed_zero3_offload,
        ),
    )
}

#: What ``compare`` runs without ``--strategies`` (plus ``fairscale_fsdp`` with CUDA).
DEFAULT_STRATEGIES: tuple[str, ...] = ("ddp", "oss", "sharded_ddp", "fsdp", "fsdp2")

_BY_ALIAS: dict[str, str] = {a: s.name for s in STRATEGIES.values() for a in s.aliases}


def _choices() -> str:
    return ", ".join(STRATEGIES)


def get_strategy(name: str) -> StrategySpec:
    """The spec of a strategy, by its name or an alias.

    Raises:
        ValueError: For an unknown name, listing the known ones.

    Examples:
        >>> get_strategy("fsdp1").name, get_strategy("zero").zero_stage
        ('fsdp', 1)
        >>> get_strategy("zero4")
        Traceback (most recent call last):
        ...
        ValueError: unknown strategy 'zero4'; choose from ddp, zero1, oss, sharded_ddp, ...
    """
    spec = STRATEGIES.get(_BY_ALIAS.get(name, name)) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown strategy {name!r}; choose from {_choices()}")
    return spec


def resolve_stage(stage: int | str) -> int:
    """ZeRO stage number from a number, ``"zero0"`` to ``"zero3"``, or any strategy name.

    Raises:
        ValueError: For an unknown name or a number outside 0 to 3.

    Examples:
        >>> resolve_stage(3), resolve_stage("zero3"), resolve_stage("sharded_ddp")
        (3, 3, 2)
        >>> resolve_stage("fsdp1"), resolve_stage("fsdp_grad_op")
        (3, 2)
        >>> resolve_stage("zero9")
        Traceback (most recent call last):
        ...
        ValueError: unknown stage 'zero9'; use 0-3, zero0-zero3 or a strategy: ddp, zero1, ...
    """
    if isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage <= 3:
        return stage
    if isinstance(stage, str):
        if stage in ("zero0", "zero1", "zero2", "zero3"):
            return int(stage[-1])
        name = _BY_ALIAS.get(stage, stage)
        if name in STRATEGIES:
            return STRATEGIES[name].zero_stage
    raise ValueError(f"unknown stage {stage!r}; use 0-3, zero0-zero3 or a strategy: {_choices()}")


def check_strategies(
    names: Iterable[str], *, cuda: bool | None = None, installed: bool = True
) -> list[StrategySpec]:
    """Look up strategy names, refusing unknown, repeated and unrunnable ones.

    Args:
        names: Names or aliases.
        cuda: Whether a GPU is visible; asked of torch when not given.
        installed: Refuse strategies whose optional extra is missing (DeepSpeed's);
            ``False`` to plan them without running them.

    Returns:
        The specs, in the order given.

    Raises:
        ValueError: For an empty list, an unknown or repeated name, or a CUDA-only strategy
            without CUDA.
        MissingRequirementError: (a ``ValueError``) For a DeepSpeed strategy without the
            ``deepspeed`` extra, naming the command that installs it.

    Examples:
        >>> [s.name for s in check_strategies(["ddp", "fsdp1"])]
        ['ddp', 'fsdp']
        >>> check_strategies(["fsdp", "fsdp1"])
        Traceback (most recent call last):
        ...
        ValueError: strategy 'fsdp' is given twice (as 'fsdp1'); name each strategy once
        >>> check_strategies(["fairscale_fsdp"], cuda=False)
        Traceback (most recent call last):
        ...
        ValueError: strategy 'fairscale_fsdp' needs CUDA, and no GPU is visible; leave it out
    """
    specs: list[StrategySpec] = []
    for name in names:
        spec = get_strategy(name)
        if spec in specs:
            again = "" if name == spec.name else f" (as {name!r})"
            raise ValueError(
                f"strategy {spec.name!r} is given twice{again}; name each strategy once"
            )
        if spec.needs_cuda:
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                raise ValueError(
                    f"strategy {spec.name!r} needs CUDA, and no GPU is visible; leave it out"
                )
        if installed and "deepspeed" in spec.needs:
            from fsdp_guide.deepspeed._preflight import check_installed

            check_installed(f"strategy {spec.name!r}")
        specs.append(spec)
    if not specs:
        raise ValueError("no strategy given; name at least one, e.g. ddp,fsdp")
    return specs
