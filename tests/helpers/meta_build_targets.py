"""Rank functions for the tests of build_sharded and load_full_state_dict (forked ranks)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from fsdp_guide.checkpoint import load_full_state_dict
from fsdp_guide.errors import CheckpointError
from fsdp_guide.memory import track_allocations
from fsdp_guide.models import MLP, Block, TinyTransformer, TransformerConfig
from fsdp_guide.wrap import LayerPolicy, SizePolicy, build_sharded, shard

CONFIG = TransformerConfig(vocab_size=64, dim=32, n_heads=2, n_layers=4, seq_len=16)


def transformer() -> nn.Module:
    return TinyTransformer(CONFIG)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank's view of the whole state dict (FSDP1 on CPU: no offload, see lesson 10)."""
    return dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))


def built_like_plain(rank: int, world_size: int) -> dict[str, Any]:
    """build_sharded against the plain model, with a seed and from the current random state."""
    warnings.filterwarnings("ignore")
    seeded = build_sharded(transformer, LayerPolicy(Block), seed=3)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    drawn = build_sharded(lambda: MLP(8, 16, 2, 4), SizePolicy(100))
    untouched = torch.equal(torch.get_rng_state(), before)
    return {
        "seeded": full_weights(seeded),
        "drawn": full_weights(drawn),
        "rng_untouched": untouched,
        "local_rows": seeded.blocks[0].fc1.weight.to_local().shape[0],
    }


def build_peaks(rank: int, world_size: int) -> dict[str, int]:
    """Peak bytes of building whole then sharding, against build_sharded."""
    warnings.filterwarnings("ignore")
    with track_allocations() as whole:
        model = transformer()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    del model
    with track_allocations() as sharded:
        model = build_sharded(transformer, LayerPolicy(Block), seed=0)
    assert model.blocks[0].fc1.weight.device.type == "cpu"  # kept alive past the block
    return {"whole": whole.peak, "sharded": sharded.peak, "kept": sharded.net}


def load_into(rank: int, world_size: int, path: str, engine: str) -> dict[str, Any]:
    """Load a full weights file into a sharded model; only rank 0 names the file."""
    warnings.filterwarnings("ignore")
    if engine == "fsdp2":
        model = build_sharded(transformer, LayerPolicy(Block), init="empty")
    else:
        torch.manual_seed(99)  # other weights than the file's
        model = shard(transformer(), engine="fsdp1", policy=LayerPolicy(Block))
    # Gloo's worker threads drop a received tensor where the profiler does not follow them,
    # so now and then a release goes unseen and the tensor looks held into the next one's
    # peak (a lost release can only raise it): the lowest of three loads is the one to bound.
    peaks = []
    for _ in range(3):
        with track_allocations() as seen:
            summary = load_full_state_dict(model, path if rank == 0 else None)
        peaks.append(seen.peak)
    return {"weights": full_weights(model), "summary": summary, "peak": min(peaks)}


def load_refused(rank: int, world_size: int, path: str) -> str:
    """The error each rank raises for a file that does not fit (nothing hangs)."""
    warnings.filterwarnings("ignore")
    model = build_sharded(transformer, LayerPolicy(Block), init="empty")
    try:
        load_full_state_dict(model, Path(path) if rank == 0 else None)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"
