"""Beyond data parallelism: tensor parallelism on one mesh dimension, FSDP2 on the other.

:class:`ParallelTransformer` is a small transformer whose blocks tensor parallelism can cut
(separate ``wq``, ``wk``, ``wv``; heads inferred from the width a rank receives);
:data:`TP_PLAN` says which layers are cut column-wise and which row-wise. :func:`parallelize`
applies ``parallelize_module`` on the ``tp`` dimension of a ``(dp, tp)`` device mesh and
``fully_shard`` on ``dp``. :func:`fsdp_guide.memory.plan` with
``tensor_parallel=`` predicts what each rank then holds and sends; :func:`train_2d` (a
launched rank) measures it, and :func:`reference_losses` trains the same model unsharded.
"""

from __future__ import annotations

from fsdp_guide.parallel._apply import mesh_2d as mesh_2d
from fsdp_guide.parallel._apply import parallelize
from fsdp_guide.parallel._model import TP_PLAN, ParallelConfig, ParallelTransformer
from fsdp_guide.parallel._model import Attention as Attention
from fsdp_guide.parallel._model import FeedForward as FeedForward
from fsdp_guide.parallel._model import ParallelBlock as ParallelBlock
from fsdp_guide.parallel._run import reference_losses, token_batch, train_2d

__all__ = [
    "TP_PLAN",
    "ParallelConfig",
    "ParallelTransformer",
    "parallelize",
    "reference_losses",
    "token_batch",
    "train_2d",
]
