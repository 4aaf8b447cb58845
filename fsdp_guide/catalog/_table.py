"""The table of strategies: one keyword-built :class:`StrategySpec` per row (private).

A leaf: nothing of the package is imported here, so the command line's argument checks read
the table before any heavy import, and every other part may read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

#: The engines the rows name: each is one adapter module of :mod:`fsdp_guide.engines`.
EngineName = Literal[
    "ddp", "zero1", "oss", "sharded_ddp", "fsdp1", "fsdp2", "fairscale_fsdp", "deepspeed"
]
#: What a strategy needs beyond torch on CPU: a GPU, or an optional extra (a package).
Requirement = Literal["cuda", "fairscale", "deepspeed"]


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """One way to train data-parallel: an engine, its settings, its ZeRO stage, its needs.

    Attributes:
        name: The one name used everywhere: the CLI, :func:`fsdp_guide.compare.run_comparison`,
            the planner, the ZeRO formulas.
        summary: What it is, in a few words.
        engine: The engine it runs on (:func:`fsdp_guide.engines.engine_for` builds it);
            several strategies share one (the four FSDP1 sharding strategies are ``"fsdp1"``).
        zero_stage: Its ZeRO stage in the textbook sense.
        settings: The engine's settings for this strategy, as keywords of the engine's
            adapter (``{"sharding_strategy": "SHARD_GRAD_OP"}``); empty for its defaults.
        needs: What it needs beyond torch on CPU: ``"cuda"``, ``"fairscale"``, ``"deepspeed"``
            (an optional extra, checked by :func:`fsdp_guide.catalog.check_strategies`
            before any rank starts).
        aliases: Other spellings accepted for it (older names of this project).
        variant_of: The row this one varies (reduce buckets, hybrid groups, offload), left
            out where one name per mechanism is wanted; ``None`` for the others.
    """

    name: str
    summary: str
    engine: EngineName
    zero_stage: int
    settings: Mapping[str, Any] = field(default_factory=dict, hash=False)
    needs: frozenset[Requirement] = frozenset()
    aliases: tuple[str, ...] = ()
    variant_of: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))

    @property
    def needs_cuda(self) -> bool:
        """Whether it only runs on GPUs (FairScale FSDP)."""
        return "cuda" in self.needs


_FAIRSCALE: frozenset[Requirement] = frozenset({"fairscale"})
_DEEPSPEED: frozenset[Requirement] = frozenset({"deepspeed"})

_ROWS = (
    StrategySpec(
        name="ddp", summary="PyTorch DDP, gradients as bucket views", engine="ddp", zero_stage=0
    ),
    StrategySpec(
        name="zero1",
        summary="DDP + torch ZeroRedundancyOptimizer",
        engine="zero1",
        zero_stage=1,
        aliases=("zero",),
    ),
    StrategySpec(
        name="oss",
        summary="DDP + FairScale OSS (sharded optimizer)",
        engine="oss",
        zero_stage=1,
        needs=_FAIRSCALE,
    ),
    StrategySpec(
        name="sharded_ddp",
        summary="FairScale OSS + ShardedDDP, reduce_buffer_size=0",
        engine="sharded_ddp",
        zero_stage=2,
        settings={"reduce_buffer_size": 0},
        needs=_FAIRSCALE,
    ),
    StrategySpec(
        name="sharded_ddp_buckets",
        summary="FairScale OSS + ShardedDDP, default reduce buckets",
        engine="sharded_ddp",
        zero_stage=2,
        settings={"reduce_buffer_size": 2**23},
        needs=_FAIRSCALE,
        variant_of="sharded_ddp",
    ),
    StrategySpec(
        name="fsdp",
        summary="PyTorch FSDP1, FULL_SHARD",
        engine="fsdp1",
        zero_stage=3,
        settings={"sharding_strategy": "FULL_SHARD"},
        aliases=("fsdp1",),
    ),
    StrategySpec(
        name="fsdp_grad_op",
        summary="PyTorch FSDP1, SHARD_GRAD_OP",
        engine="fsdp1",
        zero_stage=2,
        settings={"sharding_strategy": "SHARD_GRAD_OP"},
    ),
    StrategySpec(
        name="fsdp_no_shard",
        summary="PyTorch FSDP1, NO_SHARD",
        engine="fsdp1",
        zero_stage=0,
        settings={"sharding_strategy": "NO_SHARD"},
    ),
    StrategySpec(
        name="fsdp_hybrid",
        summary="PyTorch FSDP1, HYBRID_SHARD: sharded within a node",
        engine="fsdp1",
        zero_stage=3,
        settings={"sharding_strategy": "HYBRID_SHARD", "shard_group": 2},
        variant_of="fsdp",
    ),
    StrategySpec(
        name="fsdp2",
        summary="PyTorch FSDP2, fully_shard per block",
        engine="fsdp2",
        zero_stage=3,
    ),
    StrategySpec(
        name="fsdp2_hybrid",
        summary="PyTorch FSDP2 on a (replicate, shard) mesh: HSDP, sharded within a node",
        engine="fsdp2",
        zero_stage=3,
        settings={"shard_group": 2},
        aliases=("hsdp",),
        variant_of="fsdp2",
    ),
    StrategySpec(
        name="fsdp2_no_reshard",
        summary="PyTorch FSDP2, reshard_after_forward=False (blocks kept gathered)",
        engine="fsdp2",
        zero_stage=3,
        settings={"reshard_after_forward": False},
        variant_of="fsdp2",
    ),
    StrategySpec(
        name="fsdp2_offload",
        summary="PyTorch FSDP2 with CPUOffloadPolicy (state in host memory)",
        engine="fsdp2",
        zero_stage=3,
        settings={"offload": True},
        variant_of="fsdp2",
    ),
    StrategySpec(
        name="fairscale_fsdp",
        summary="FairScale FSDP (CUDA)",
        engine="fairscale_fsdp",
        zero_stage=3,
        needs=frozenset({"cuda", "fairscale"}),
    ),
    StrategySpec(
        name="deepspeed_zero1",
        summary="DeepSpeed ZeRO-1, torch Adam",
        engine="deepspeed",
        zero_stage=1,
        settings={"stage": 1},
        needs=_DEEPSPEED,
    ),
    StrategySpec(
        name="deepspeed_zero2",
        summary="DeepSpeed ZeRO-2, torch Adam",
        engine="deepspeed",
        zero_stage=2,
        settings={"stage": 2},
        needs=_DEEPSPEED,
        aliases=("zero2",),
    ),
    StrategySpec(
        name="deepspeed_zero2_offload",
        summary="DeepSpeed ZeRO-2, optimizer offloaded to CPU",
        engine="deepspeed",
        zero_stage=2,
        settings={"stage": 2, "offload_optimizer": True},
        needs=_DEEPSPEED,
        variant_of="deepspeed_zero2",
    ),
    StrategySpec(
        name="deepspeed_zero3",
        summary="DeepSpeed ZeRO-3, torch Adam",
        engine="deepspeed",
        zero_stage=3,
        settings={"stage": 3},
        needs=_DEEPSPEED,
        aliases=("zero3",),
    ),
    StrategySpec(
        name="deepspeed_zero3_offload",
        summary="DeepSpeed ZeRO-3, optimizer and parameters offloaded to CPU",
        engine="deepspeed",
        zero_stage=3,
        settings={"stage": 3, "offload_optimizer": True, "offload_params": True},
        needs=_DEEPSPEED,
        variant_of="deepspeed_zero3",
    ),
)

#: Every strategy, by name, in the order of the ZeRO stages.
STRATEGIES: dict[str, StrategySpec] = {spec.name: spec for spec in _ROWS}

#: What ``compare`` runs without ``--strategies`` (plus ``fairscale_fsdp`` with CUDA).
DEFAULT_STRATEGIES: tuple[str, ...] = ("ddp", "oss", "sharded_ddp", "fsdp", "fsdp2")
