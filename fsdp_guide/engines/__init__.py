"""Engines: the implementations that shard a model, one adapter module each.

An *engine* is what trains a model on many ranks: PyTorch DDP
(:mod:`~fsdp_guide.engines.ddp`), ``ZeroRedundancyOptimizer``
(:mod:`~fsdp_guide.engines.zero1`), FairScale OSS and ShardedDDP
(:mod:`~fsdp_guide.engines.oss`, :mod:`~fsdp_guide.engines.sharded_ddp`), PyTorch FSDP1 and
FSDP2 (:mod:`~fsdp_guide.engines.fsdp1`, :mod:`~fsdp_guide.engines.fsdp2`), FairScale FSDP
(:mod:`~fsdp_guide.engines.fairscale_fsdp`) and DeepSpeed ZeRO
(:mod:`~fsdp_guide.engines.deepspeed`). A *strategy* is a row of
:data:`fsdp_guide.catalog.STRATEGIES`: an engine and its settings.
:func:`engine_for` builds a strategy's engine; :func:`detect` names the engine of a trained
model.

Each adapter is an :class:`Engine`: how it wraps a model and builds the optimizer
(:meth:`Engine.build`, used by :func:`wrap_for_strategy`), what each rank holds after
``optimizer.step()`` (:meth:`Engine.layout`, in elements: a :class:`Layout`), the largest
short-lived buffer (:meth:`Engine.transient`), the collectives of a step
(:meth:`Engine.collectives`), and how its state goes in and out of a checkpoint
(:meth:`Engine.full_state`, :meth:`Engine.load_full_state`, :meth:`Engine.sharded_state`,
:attr:`Engine.sharded_layout`). The FSDP engines are also :class:`UnitEngine`\\ s: how a wrap
policy becomes units and how to look inside one, which :mod:`fsdp_guide.wrap` asks.

Adding an engine is one adapter module here, its entry in ``ENGINES`` and its rows in the
catalog; memory, communication, comparison and the command line need nothing more.

Examples:
    >>> from fsdp_guide.engines import engine_for
    >>> engine = engine_for("fsdp")
    >>> engine.name, engine.stage_at_step, engine.collectives(1000, 4).payload
    ('fsdp1', 3, {'reduce_scatter': 1000, 'all_gather': 2000})
"""

from __future__ import annotations

from fsdp_guide.engines._base import Built, Engine
from fsdp_guide.engines._checkpoint import TorchStateDict, kept_fresh, without_state
from fsdp_guide.engines._records import Collectives, Layout, Transient
from fsdp_guide.engines._registry import (
    ENGINES,
    GRAD_BUFFERS,
    PARAM_BUFFERS,
    detect,
    engine_class,
    engine_for,
    get_engine,
    get_unit_engine,
    unit_engines,
    unit_of,
    with_wrap,
    wrap_for_strategy,
)
from fsdp_guide.engines._shape import ModelShape
from fsdp_guide.engines._step import (
    Gathered,
    ModuleCalls,
    StepPeak,
    StepSizes,
    Stretch,
    module_calls,
)
from fsdp_guide.engines._units import (
    UNIT_RULES,
    UnitEngine,
    UnitPolicy,
    UnitRule,
    UnitView,
    block_classes,
    follows_units,
    model_shape,
    unit_names,
    unit_shapes,
    unit_summary,
)
from fsdp_guide.engines.ddp import DDP
from fsdp_guide.engines.deepspeed import DeepSpeedZero, deepspeed_layout
from fsdp_guide.engines.fairscale_fsdp import FairScaleFSDP
from fsdp_guide.engines.fsdp1 import FSDP1
from fsdp_guide.engines.fsdp2 import FSDP2, local_tensor
from fsdp_guide.engines.oss import OSS
from fsdp_guide.engines.plain import Plain
from fsdp_guide.engines.sharded_ddp import ShardedDDP
from fsdp_guide.engines.zero1 import Zero1

__all__ = [
    "DDP",
    "ENGINES",
    "FSDP1",
    "FSDP2",
    "GRAD_BUFFERS",
    "OSS",
    "PARAM_BUFFERS",
    "UNIT_RULES",
    "Built",
    "Collectives",
    "DeepSpeedZero",
    "Engine",
    "FairScaleFSDP",
    "Gathered",
    "Layout",
    "ModelShape",
    "ModuleCalls",
    "Plain",
    "ShardedDDP",
    "StepPeak",
    "StepSizes",
    "Stretch",
    "TorchStateDict",
    "Transient",
    "UnitEngine",
    "UnitPolicy",
    "UnitRule",
    "UnitView",
    "Zero1",
    "block_classes",
    "deepspeed_layout",
    "detect",
    "engine_class",
    "engine_for",
    "follows_units",
    "get_engine",
    "get_unit_engine",
    "kept_fresh",
    "local_tensor",
    "model_shape",
    "module_calls",
    "unit_engines",
    "unit_names",
    "unit_of",
    "unit_shapes",
    "unit_summary",
    "with_wrap",
    "without_state",
    "wrap_for_strategy",
]
