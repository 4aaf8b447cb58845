"""The one vocabulary of sharding strategies: a table every part of the package reads.

Each strategy has one name, used by ``python -m fsdp_guide compare --strategies``,
:func:`fsdp_guide.compare.run_comparison`, the planner (:func:`fsdp_guide.memory.plan`) and
the ZeRO formulas (:func:`fsdp_guide.memory.estimate_model_state` takes any strategy name as
its stage). Each row is a record (a ``StrategySpec``): which engine runs it and with which
settings, which ZeRO stage it is, what it needs (CUDA, FairScale, DeepSpeed). What the engine
does with those settings (how it wraps a model, what each rank holds, what it sends) is the
engine's adapter's to say (:func:`fsdp_guide.engines.engine_for`). Adding a strategy to an
existing engine is adding one row to :data:`STRATEGIES`.

The catalog imports nothing else of the package: everything may read it.

=========================== ===== ============== =================================================
name                        stage engine         what it is
=========================== ===== ============== =================================================
``ddp``                     0     ddp            PyTorch DDP
``zero1`` (``zero``)        1     zero1          DDP + ``ZeroRedundancyOptimizer``
``oss``                     1     oss            DDP + FairScale OSS
``sharded_ddp``             2     sharded_ddp    FairScale OSS + ShardedDDP, no reduce buckets
``sharded_ddp_buckets``     2     sharded_ddp    the same with its default reduce buckets
``fsdp`` (``fsdp1``)        3     fsdp1          PyTorch FSDP1, ``FULL_SHARD``
``fsdp_grad_op``            2     fsdp1          PyTorch FSDP1, ``SHARD_GRAD_OP``
``fsdp_no_shard``           0     fsdp1          PyTorch FSDP1, ``NO_SHARD``
``fsdp_hybrid``             3     fsdp1          PyTorch FSDP1, ``HYBRID_SHARD`` in pairs
``fsdp2``                   3     fsdp2          PyTorch FSDP2, ``fully_shard`` per block
``fsdp2_hybrid``            3     fsdp2          PyTorch FSDP2 on a 2-D mesh: HSDP in pairs
``fsdp2_no_reshard``        3     fsdp2          PyTorch FSDP2, blocks kept gathered to backward
``fsdp2_offload``           3     fsdp2          PyTorch FSDP2, ``CPUOffloadPolicy``
``fairscale_fsdp``          3     fairscale_fsdp FairScale FSDP (CUDA only)
``deepspeed_zero1``         1     deepspeed      DeepSpeed ZeRO-1 (the ``deepspeed`` extra)
``deepspeed_zero2``         2     deepspeed      DeepSpeed ZeRO-2
``deepspeed_zero2_offload`` 2     deepspeed      DeepSpeed ZeRO-2, optimizer on the CPU
``deepspeed_zero3``         3     deepspeed      DeepSpeed ZeRO-3
``deepspeed_zero3_offload`` 3     deepspeed      DeepSpeed ZeRO-3, optimizer and parameters on CPU
=========================== ===== ============== =================================================

Stages are accepted everywhere as ``0``-``3``, ``"zero0"``-``"zero3"`` or any name above.

Examples:
    >>> from fsdp_guide.catalog import get_strategy
    >>> spec = get_strategy("fsdp1")
    >>> spec.name, spec.engine, spec.zero_stage, sorted(spec.needs)
    ('fsdp', 'fsdp1', 3, [])
"""

from __future__ import annotations

from fsdp_guide.catalog._lookup import check_strategies as check_strategies
from fsdp_guide.catalog._lookup import cpu_strategies as cpu_strategies
from fsdp_guide.catalog._lookup import extra_installed as extra_installed
from fsdp_guide.catalog._lookup import get_strategy as get_strategy
from fsdp_guide.catalog._lookup import install_command as install_command
from fsdp_guide.catalog._lookup import resolve_stage as resolve_stage
from fsdp_guide.catalog._table import DEFAULT_STRATEGIES as DEFAULT_STRATEGIES
from fsdp_guide.catalog._table import STRATEGIES
from fsdp_guide.catalog._table import EngineName as EngineName
from fsdp_guide.catalog._table import Requirement as Requirement
from fsdp_guide.catalog._table import StrategySpec as StrategySpec

__all__ = [
    "STRATEGIES",
]
