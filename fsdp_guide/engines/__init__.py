"""Engines: the implementations that shard a model, one adapter module each.

An *engine* is what trains a model on many ranks: PyTorch DDP, ``ZeroRedundancyOptimizer``,
FairScale OSS and ShardedDDP, PyTorch FSDP1 and FSDP2, FairScale FSDP and DeepSpeed ZeRO,
one module each here. A *strategy* is a row of :data:`fsdp_guide.catalog.STRATEGIES`: an
engine and its settings. :func:`engine_for` is the one way to get an engine: a strategy's,
configured with its settings, or the engine of a model that one wrapped.

Each adapter is an :class:`Engine`: how it wraps a model and builds the optimizer
(:meth:`Engine.build`), what each rank holds after ``optimizer.step()``
(:meth:`Engine.layout`, in elements: a :class:`Layout`), the largest short-lived buffer
(:meth:`Engine.transient`: a ``Transient``), the collectives of a step
(:meth:`Engine.collectives`: :class:`Collectives`), and how its state goes in and out of a
checkpoint (:meth:`Engine.full_state`, :meth:`Engine.load_full_state`,
:meth:`Engine.sharded_state`, :attr:`Engine.sharded_layout`). The FSDP engines are also
:class:`UnitEngine`\\ s: how a wrap policy becomes units and how to look inside one, which
:mod:`fsdp_guide.wrap` asks. :func:`model_shape` is what the predictions are computed from:
a model's units and buffers.

Adding an engine is one adapter module here, its entry in ``ENGINES`` and its rows in the
catalog; memory, communication, comparison and the command line need nothing more.

Examples:
    >>> from fsdp_guide.engines import engine_for
    >>> engine = engine_for("fsdp")
    >>> engine.name, engine.stage_at_step, engine.collectives(1000, 4).payload
    ('fsdp1', 3, {'reduce_scatter': 1000, 'all_gather': 2000})
"""

from __future__ import annotations

from fsdp_guide.engines._base import Built as Built
from fsdp_guide.engines._base import Engine
from fsdp_guide.engines._checkpoint import TorchStateDict as TorchStateDict
from fsdp_guide.engines._checkpoint import kept_fresh as kept_fresh
from fsdp_guide.engines._checkpoint import without_state as without_state
from fsdp_guide.engines._deepspeed_layout import deepspeed_layout as deepspeed_layout
from fsdp_guide.engines._records import Collectives, Layout
from fsdp_guide.engines._records import Transient as Transient
from fsdp_guide.engines._registry import ENGINES as ENGINES
from fsdp_guide.engines._registry import GRAD_BUFFERS as GRAD_BUFFERS
from fsdp_guide.engines._registry import PARAM_BUFFERS as PARAM_BUFFERS
from fsdp_guide.engines._registry import UNIT_ENGINES as UNIT_ENGINES
from fsdp_guide.engines._registry import engine_class as engine_class
from fsdp_guide.engines._registry import engine_for
from fsdp_guide.engines._registry import unit_engine as unit_engine
from fsdp_guide.engines._registry import unit_of as unit_of
from fsdp_guide.engines._registry import with_wrap as with_wrap
from fsdp_guide.engines._registry import wrap_for_strategy as wrap_for_strategy
from fsdp_guide.engines._shape import ModelShape as ModelShape
from fsdp_guide.engines._step import Gathered as Gathered
from fsdp_guide.engines._step import ModuleCalls as ModuleCalls
from fsdp_guide.engines._step import StepPeak as StepPeak
from fsdp_guide.engines._step import StepSizes as StepSizes
from fsdp_guide.engines._step import Stretch as Stretch
from fsdp_guide.engines._step import module_calls as module_calls
from fsdp_guide.engines._units import UNIT_RULES as UNIT_RULES
from fsdp_guide.engines._units import UnitEngine, model_shape
from fsdp_guide.engines._units import UnitPolicy as UnitPolicy
from fsdp_guide.engines._units import UnitRule as UnitRule
from fsdp_guide.engines._units import UnitView as UnitView
from fsdp_guide.engines._units import block_classes as block_classes
from fsdp_guide.engines._units import follows_units as follows_units
from fsdp_guide.engines._units import unit_names as unit_names
from fsdp_guide.engines._units import unit_shapes as unit_shapes
from fsdp_guide.engines._units import unit_summary as unit_summary
from fsdp_guide.engines.ddp import DDP as DDP
from fsdp_guide.engines.deepspeed import DeepSpeedZero as DeepSpeedZero
from fsdp_guide.engines.fairscale_fsdp import FairScaleFSDP as FairScaleFSDP
from fsdp_guide.engines.fsdp1 import FSDP1 as FSDP1
from fsdp_guide.engines.fsdp2 import FSDP2 as FSDP2
from fsdp_guide.engines.fsdp2 import local_tensor as local_tensor
from fsdp_guide.engines.oss import OSS as OSS
from fsdp_guide.engines.plain import Plain as Plain
from fsdp_guide.engines.sharded_ddp import ShardedDDP as ShardedDDP
from fsdp_guide.engines.zero1 import Zero1 as Zero1

# Readers and engine authors use these; a name imported ``as`` itself above is for the
# package's other sub-packages (checkpoints, wrapping, planning), not documented for readers.
__all__ = [
    "Collectives",
    "Engine",
    "Layout",
    "UnitEngine",
    "engine_for",
    "model_shape",
]
