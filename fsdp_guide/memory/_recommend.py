"""Which plan to pick: maintained engines first, then the least communication (private)."""

from __future__ import annotations

from collections.abc import Sequence

from fsdp_guide.catalog import get_strategy
from fsdp_guide.engines import engine_class
from fsdp_guide.memory._plan_record import Plan


def maintenance_rank(strategy: str) -> int:
    """0 for a maintained engine, 1 for a superseded one (FSDP1), 2 for FairScale's.

    The engine's adapter says it (:attr:`fsdp_guide.engines.Engine.maintenance`).

    Examples:
        >>> [maintenance_rank(s) for s in ("fsdp2", "ddp", "fsdp", "sharded_ddp")]
        [0, 0, 1, 2]
    """
    try:
        engine = get_strategy(strategy).engine
    except ValueError:  # a name outside the catalog: nothing is known against it
        return 0
    return engine_class(engine).maintenance


def recommend(
    plans: Sequence[Plan],
    gpu_memory: int,
    margin: float = 0.1,
    host_memory: int | None = None,
) -> Plan | None:
    """The plan whose step fits ``gpu_memory`` less the margin, maintained engines first.

    Among the plans whose step peak fits (and whose host memory fits ``host_memory``, when
    given), those on a maintained engine (DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed)
    come first, then FSDP1, then FairScale's; within a rank, the fewest bytes on the wire
    between nodes, then on the wire in all, then the least offloaded to host memory (offload
    only where it is needed: the host's copies and its optimizer step are slow), then the
    lowest step peak, then the first plan given.

    Examples:
        >>> from fsdp_guide.memory import plan
        >>> from fsdp_guide.models import MLP
        >>> plans = [plan(MLP(), batch_size=8, seq_len=1, world_size=2, strategy=s)
        ...          for s in ("ddp", "sharded_ddp", "fsdp", "fsdp2")]
        >>> recommend(plans, 10**9).strategy  # as much on the wire as DDP here, less held
        'fsdp2'
        >>> recommend(plans[:2], 10**9).strategy  # maintained before FairScale
        'ddp'
        >>> recommend(plans, 10) is None
        True
    """
    fitting = [p for p in plans if p.fits(gpu_memory, margin, host_memory=host_memory)]
    # min() keeps the first of equal keys: the order given breaks exact ties.
    return min(
        fitting,
        key=lambda p: (
            maintenance_rank(p.strategy),
            p.communication.wire_bytes(link="inter"),
            p.communication.wire_bytes(),
            p.host().total,
            p.step_peak,
        ),
        default=None,
    )
