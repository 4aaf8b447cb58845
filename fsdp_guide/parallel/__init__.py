"""Beyond data parallelism: tensor parallelism on one mesh dimension, FSDP2 on the other.

:class:`ParallelTransformer` is a small transformer whose blocks tensor parallelism can cut
(separate ``wq``, ``wk``, ``wv``; heads inferred from the width a rank receives);
:data:`TP_PLAN` says which layers are cut column-wise and which row-wise. :func:`parallelize`
applies ``parallelize_module`` on the ``tp`` dimension of a ``(dp, tp)`` device mesh and
``fully_shard`` on ``dp``. :func:`fsdp_guide.memory.plan` with
``tensor_parallel=`` predicts what each rank then holds and sends; :func:`train_2d` (a
launched rank) measures it, and :func:`reference_losses` trains the same model unsharded.

Pipeline parallelism cuts the model into stages of whole layers instead
(:meth:`ParallelTransformer.pipeline_layers`: its embeddings, the blocks, its norm and
head): :func:`build_pipeline` puts this rank's stages under one of
``torch.distributed.pipelining``'s schedules, FSDP2 on a data-parallel mesh if given, and
:func:`train_pipeline` (a launched rank) measures what ``plan(..., pipeline_parallel=p)``
predicts, and when each action ran.

Context parallelism cuts the sequence: :func:`ring_attention` computes exact attention over
a sequence spread over ranks (each rank's share cut by :func:`shard_sequence`), passing K/V
blocks round a ring of point-to-point messages; :func:`ring_schedule` says how much of a
block each rank computes at each step (causal masking leaves ranks idle unless the sequence
is cut ``"zigzag"``), :func:`record_ring_steps` times the steps and :func:`plot_ring_steps`
draws them, and :func:`train_context_parallel` trains :class:`ParallelTransformer` that way
with FSDP2.

Expert parallelism spreads a mixture of experts' experts over ranks:
:class:`ExpertParallelMoE` takes a transformers MoE block and routes its tokens with two
all-to-alls (what one forward sent and received is in its ``routing`` record);
:func:`train_expert_parallel` trains a transformers MoE model that way with FSDP2, and
:func:`reference_moe_losses` trains it in one process.
"""

from __future__ import annotations

from fsdp_guide.parallel._apply import mesh_2d as mesh_2d
from fsdp_guide.parallel._apply import parallelize
from fsdp_guide.parallel._context import train_context_parallel
from fsdp_guide.parallel._experts import ExpertParallelMoE
from fsdp_guide.parallel._experts import Routing as Routing
from fsdp_guide.parallel._experts_run import reference_moe_losses, train_expert_parallel
from fsdp_guide.parallel._model import TP_PLAN, ParallelBlock, ParallelConfig, ParallelTransformer
from fsdp_guide.parallel._model import Attention as Attention
from fsdp_guide.parallel._model import FeedForward as FeedForward
from fsdp_guide.parallel._pipeline import Pipeline as Pipeline
from fsdp_guide.parallel._pipeline import build_pipeline
from fsdp_guide.parallel._pipeline_plot import plot_schedule
from fsdp_guide.parallel._pipeline_run import train_pipeline
from fsdp_guide.parallel._ring import ring_attention
from fsdp_guide.parallel._ring_layout import ring_schedule, shard_sequence
from fsdp_guide.parallel._ring_steps import plot_ring_steps, record_ring_steps
from fsdp_guide.parallel._run import reference_losses, token_batch, train_2d

__all__ = [
    "TP_PLAN",
    "ExpertParallelMoE",
    "ParallelBlock",
    "ParallelConfig",
    "ParallelTransformer",
    "build_pipeline",
    "parallelize",
    "plot_ring_steps",
    "plot_schedule",
    "record_ring_steps",
    "reference_losses",
    "reference_moe_losses",
    "ring_attention",
    "ring_schedule",
    "shard_sequence",
    "token_batch",
    "train_2d",
    "train_context_parallel",
    "train_expert_parallel",
    "train_pipeline",
]
