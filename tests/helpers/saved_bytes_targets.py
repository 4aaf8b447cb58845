"""The model, batches and CUDA rank function of the saved-activation tests under FSDP.

``tests/checkpoint/test_checkpointing_sharded.py`` counts, with
:func:`fsdp_guide.wrap.saved_activation_bytes`, the activations each rank keeps under FSDP and
compares them with one process running its local batch. The FairScale rank runs on CUDA, so
it is spawned, and a spawned rank imports the function it runs: it lives here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from wrap_configurations import CONFIG

from fsdp_guide.models import Block, TinyTransformer, loss_fn, shard_batch, synthetic_batch
from fsdp_guide.wrap import LayerPolicy, checkpoint_layers, saved_activation_bytes, shard

GLOBAL_BATCH = 8
WORLD_SIZE = 2
STEPS = 2  # the second step runs with FSDP's lazy initialisation done


def build(checkpointed: bool) -> nn.Module:
    """The seeded TinyTransformer, each Block checkpointed (PyTorch's wrapper) or not."""
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG)
    return checkpoint_layers(model, Block) if checkpointed else model


def local_batch(rank: int, step: int, world_size: int = WORLD_SIZE) -> Any:
    """This rank's slice of the seeded global batch of ``step``."""
    batch = synthetic_batch("transformer", GLOBAL_BATCH, step=step, config=CONFIG)
    return shard_batch(batch, rank, world_size)


def measure_fairscale(rank: int, world_size: int) -> dict[bool, dict[str, list[int]]]:
    """FairScale FSDP (CUDA) against this rank's own unsharded count on the same GPU.

    The layers are checkpointed with PyTorch's wrapper, as :func:`build` does for every engine;
    ``shard(engine="fairscale")`` puts FairScale's checkpointing inside each unit instead.
    """
    results: dict[bool, dict[str, list[int]]] = {}
    for checkpointed in (False, True):
        batch = tuple(t.cuda() for t in local_batch(rank, 0, world_size))
        plain = build(checkpointed).cuda()
        expected, _ = saved_activation_bytes(plain, lambda: loss_fn(plain, batch))  # noqa: B023
        model = shard(build(checkpointed).cuda(), engine="fairscale", policy=LayerPolicy(Block))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        counts = []
        for step in range(STEPS):
            step_batch = tuple(t.cuda() for t in local_batch(rank, step, world_size))
            nbytes, loss = saved_activation_bytes(model, lambda: loss_fn(model, step_batch))  # noqa: B023
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad()
            counts.append(nbytes)
        results[checkpointed] = {"expected": [expected] * STEPS, "sharded": counts}
    return results
