"""Memory per rank, measured, predicted and planned.

:func:`measure_model_state` counts the bytes of parameters, gradients and optimizer state
that a rank holds; :func:`estimate_model_state` gives what the ZeRO formulas predict for
a stage (`Rajbhandari et al., 2020 <https://arxiv.org/abs/1910.02054>`__),
:func:`predict_model_state` for a strategy (the formula its engine follows);
:func:`track_allocations` gives the most bytes one block of code holds at once (building,
loading or saving a model).
Communication is :mod:`fsdp_guide.comm`'s.

**Planning.** :func:`plan` adds what a rank holds at its peak, without allocating the model:
the model state of every rank (to the byte, as each engine lays it out), the activations
saved for backward (traced on fake tensors), the largest transient buffer and the
communication per step, in a :class:`Plan`. A pipeline's stages and schedule are planned
by :func:`pipeline_stages` and :func:`pipeline_schedule`.

**When to measure.** Call :func:`measure_model_state` **after** ``optimizer.step()`` and **before**
``optimizer.zero_grad()``. At that point every kind of state exists at once: the
gradients of the step are still there and the optimizer state has been created. What is
counted there, per strategy:

* DDP: full parameters, full gradients, full optimizer state (ZeRO stage 0).
* ZeroRedundancyOptimizer / FairScale OSS (with DDP): full parameters and gradients; the
  optimizer state of the tensors this rank owns (stage 1).
* FairScale ShardedDDP + OSS: full parameters; the gradients of the tensors this rank
  owns, since ShardedDDP drops the others after reducing them (stage 2) *unless* they sit
  in its reduce buckets, which stay allocated (see ``full_grads`` in
  :func:`estimate_model_state`).
* FSDP (FairScale, PyTorch FSDP1, FSDP2): this rank's parameter shard, gradient shard and
  optimizer state for that shard (stage 3). FSDP1's ``SHARD_GRAD_OP`` is ZeRO-2 during
  forward and backward, but it frees the unsharded parameters after backward, so at this
  point it holds stage-3 state; ``NO_SHARD`` holds stage-0 state.
* DeepSpeed engines: ``engine.step()`` steps and clears the gradients in one call, so the
  state is measured after it, with the gradients gone except ZeRO-3's permanent
  gradient-partition buffer. ZeRO-1/2 hold full parameters and an fp32 master copy of
  their partition (``ModelState.master``) beside the optimizer state of that partition;
  ZeRO-3 a parameter shard, a master shard and the gradient buffer, plus its reduce
  bucket (``ModelState.buckets``). :func:`estimate_deepspeed_state` predicts it exactly.

Each storage is counted once, whole: tensors that are views of one flat buffer (OSS's
parameter buckets, DDP's gradient buckets, FSDP's flat parameters and their padding) add
that buffer's size once. FSDP's private buffers hanging off a flat parameter (the
unsharded ``_full_param_padded``, mixed-precision shards, ...) are counted when they are
allocated. DDP's gradient buckets, when the gradients are not views of them
(``gradient_as_bucket_view=False``), are a second full copy of the gradients: they are
reported apart, as ``ModelState.buckets``, and are in its total. DDP keeps its buckets for
the whole run, so they are counted after ``zero_grad()`` too: as ``buckets`` without views,
as ``grads`` with them (the gradients' storage is still held while every ``.grad`` is
None). Activations and module buffers are not counted.
"""

from __future__ import annotations

from fsdp_guide.memory._accumulation import Accumulation as Accumulation

# Names beside __all__ are for the package's other sub-packages (the command line, the
# benchmarks), not documented for readers; ``X as X`` keeps them importable under mypy.
from fsdp_guide.memory._allocations import Allocations as Allocations
from fsdp_guide.memory._allocations import track_allocations
from fsdp_guide.memory._measure import PeakMemory as PeakMemory
from fsdp_guide.memory._measure import measure_model_state
from fsdp_guide.memory._measure import peak_memory as peak_memory
from fsdp_guide.memory._plan import plan
from fsdp_guide.memory._plan_record import Plan
from fsdp_guide.memory._pp import pipeline_stages
from fsdp_guide.memory._pp_record import PipelinePlan as PipelinePlan
from fsdp_guide.memory._predict import estimate_deepspeed_state, predict_model_state, state_per_rank
from fsdp_guide.memory._recommend import recommend as recommend
from fsdp_guide.memory._schedule import PipelineAction as PipelineAction
from fsdp_guide.memory._schedule import PipelineSchedule as PipelineSchedule
from fsdp_guide.memory._schedule import TimedAction as TimedAction
from fsdp_guide.memory._schedule import pipeline_schedule
from fsdp_guide.memory._state import ModelState as ModelState
from fsdp_guide.memory._trace import build_on_meta as build_on_meta
from fsdp_guide.memory._trace import traced_activation_bytes as traced_activation_bytes
from fsdp_guide.memory._zero import BytesPerParam as BytesPerParam
from fsdp_guide.memory._zero import OptimizerName as OptimizerName
from fsdp_guide.memory._zero import Precision as Precision
from fsdp_guide.memory._zero import bytes_per_param as bytes_per_param
from fsdp_guide.memory._zero import estimate_model_state, format_bytes
from fsdp_guide.memory._zero import parse_size as parse_size

__all__ = [
    "Plan",
    "estimate_deepspeed_state",
    "estimate_model_state",
    "format_bytes",
    "measure_model_state",
    "pipeline_schedule",
    "pipeline_stages",
    "plan",
    "predict_model_state",
    "state_per_rank",
    "track_allocations",
]
