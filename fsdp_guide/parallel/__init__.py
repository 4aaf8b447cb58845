"""Beyond data parallelism: tensor parallelism on one mesh dimension, FSDP2 on the other.

:class:`ParallelTransformer` is a small transformer whose blocks tensor parallelism can cut
(separate ``wq``, ``wk``, ``wv``; heads inferred from the width a rank receives);
:data:`TP_PLAN` says which layers are cut column-wise and which row-wise. :func:`mesh_2d`
builds a ``(dp, tp)`` device mesh and :func:`parallelize` applies ``parallelize_module`` on
``tp`` and ``fully_shard`` on ``dp``. :func:`fsdp_guide.memory.plan` with
``tensor_parallel=`` predicts what each rank then holds and sends; :func:`train_2d` (a
launched rank) measures it, and :func:`reference_losses` trains the same model unsharded.

Pipeline parallelism cuts the model into stages of whole layers instead
(:meth:`ParallelTransformer.pipeline_layers`: its embeddings, the blocks, its norm and
head): :func:`build_pipeline` puts this rank's stages under one of
``torch.distributed.pipelining``'s schedules, FSDP2 on a data-parallel mesh if given, and
:func:`train_pipeline` (a launched rank) measures what ``plan(..., pipeline_parallel=p)``
predicts, and when each action ran.
"""

from __future__ import annotations

from fsdp_guide.parallel._apply import mesh_2d, parallelize
from fsdp_guide.parallel._model import (
    TP_PLAN,
    Attention,
    FeedForward,
    ParallelBlock,
    ParallelConfig,
    ParallelTransformer,
)
from fsdp_guide.parallel._pipeline import Pipeline, build_pipeline
from fsdp_guide.parallel._pipeline_plot import plot_schedule
from fsdp_guide.parallel._pipeline_run import train_pipeline
from fsdp_guide.parallel._run import reference_losses, token_batch, train_2d

__all__ = [
    "TP_PLAN",
    "Attention",
    "FeedForward",
    "ParallelBlock",
    "ParallelConfig",
    "ParallelTransformer",
    "Pipeline",
    "build_pipeline",
    "mesh_2d",
    "parallelize",
    "plot_schedule",
    "reference_losses",
    "token_batch",
    "train_2d",
    "train_pipeline",
]
