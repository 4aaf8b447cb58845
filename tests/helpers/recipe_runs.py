"""What a rank runs when the tests start the fine-tuning recipes of ``examples/recipes``.

The recipes are plain scripts; the tests import them by file and call their own functions:
:func:`load_then_train` builds a model and loads its weights as the recipe does, following
the bytes the rank allocates meanwhile, gathers the loaded weights whole to compare them with
the files, then runs the recipe's ``main`` under a collective counter.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_guide.comm import count_collectives
from fsdp_guide.memory import track_allocations

ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = ROOT / "examples" / "recipes"
#: Engine -> the recipe's module name (its file in examples/recipes).
RECIPES = {
    "fsdp2": "fsdp2_finetune",
    "ddp": "ddp_finetune",
    "deepspeed_zero3": "deepspeed_zero3_finetune",
}


def recipe(engine: str) -> Any:
    """The recipe's module, imported from its file."""
    if str(RECIPES_DIR) not in sys.path:
        sys.path.insert(0, str(RECIPES_DIR))
    return importlib.import_module(RECIPES[engine])


def file_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``.safetensors`` file in ``directory``."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        weights.update(load_file(path))
    return weights


def _deepspeed_ready() -> Any:
    """Import DeepSpeed as the recipe's ``main`` does before it builds a model (on CPU)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    return deepspeed


def build(engine: str, argv: list[str]) -> Any:
    """The recipe's model, built by the recipe's own function, before any weights are loaded."""
    module = recipe(engine)
    args = module.parse_args(argv)
    config = module.model_config(args)
    if engine == "fsdp2":
        return module.build_model(
            args, config, module.make_mesh(args, "cpu", dist.get_world_size())
        )
    if engine == "ddp":
        return module.build_model(args, config, torch.device("cpu"))
    _deepspeed_ready()
    return module.build_model(args, config, module.deepspeed_config(args, on_gpu=False))


@contextlib.contextmanager
def _most_gathered(model: Any) -> Iterator[list[int]]:
    """The most bytes of ZeRO-3 parameters held whole at once, each time one is gathered.

    Following allocations cannot tell it under DeepSpeed on CPU: the count misses releases
    there, and grows with every parameter gathered, while the tensors alive after loading
    are the partitions alone.
    """
    most = [0]
    if "deepspeed" not in sys.modules:
        yield most
        return
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    enter = GatheredParameters.__enter__

    def counting(self: Any) -> Any:
        entered = enter(self)
        whole = sum(
            p.ds_numel * p.element_size()
            for p in model.parameters()
            if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE
        )
        most[0] = max(most[0], whole)
        return entered

    GatheredParameters.__enter__ = counting  # type: ignore[method-assign]
    try:
        yield most
    finally:
        GatheredParameters.__enter__ = enter  # type: ignore[method-assign]


def _held(model: Any) -> list[torch.Tensor]:
    """The parameter storage this rank holds: FSDP2 shards, ZeRO-3 partitions, or whole."""
    from torch.distributed.tensor import DTensor

    held = []
    for param in model.parameters():
        if hasattr(param, "ds_tensor"):
            held.append(param.ds_tensor)
        elif isinstance(param, DTensor):
            held.append(param.to_local())
        else:
            held.append(param)
    return held


def gathered(engine: str, model: Any) -> dict[str, torch.Tensor]:
    """The model's weights whole: on rank 0 only for FSDP2, on every rank for the others."""
    if engine == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return dict(get_model_state_dict(model, options=options))
    if engine == "ddp":
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    import deepspeed

    whole = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):  # a collective: every rank
            whole[name] = param.detach().clone()
    return whole


def load_then_train(
    rank: int, world_size: int, engine: str, argv: list[str], model_dir: str
) -> dict[str, Any]:
    """Build and load as the recipe does, compare with the files, then train with ``main``.

    Returns:
        ``built``: bytes of the parameters this rank holds once the model is built (its
        shards, or the whole model); ``peak``: bytes allocated at most while building and
        loading; ``gathered``: under ZeRO-3, the most bytes of parameters held whole at once
        while loading;
        ``compared``/``differing``: weights compared with the files, and those not equal;
        ``log``: the recipe's log (rank 0's losses and norms);
        ``comm``: calls and payload bytes of each kind of collective ``main`` issued on
        this rank (``comm_complete``: whether the counter saw them all).
    """
    torch.set_num_threads(1)
    # One window, so that a tensor built and then replaced while loading (a ZeRO-3 partition
    # written again) counts once. The garbage building leaves in reference cycles is
    # collected before loading, as Python's collector would.
    with track_allocations() as seen:
        model = build(engine, argv)
        built = sum(t.numel() * t.element_size() for t in _held(model))
        gc.collect()
        with _most_gathered(model) as held_whole:
            recipe(engine).load_weights(model, recipe(engine).parse_args(argv).model)
    whole = gathered(engine, model)
    expected = file_weights(model_dir)
    differing = sorted(k for k in whole if k in expected and not torch.equal(whole[k], expected[k]))
    compared = len([k for k in whole if k in expected])
    del model, whole
    gc.collect()
    with count_collectives() as counter:
        log = recipe(engine).main(argv)
    stats = counter.stats
    comm = {kind: (c.calls, c.bytes) for kind, c in stats.kinds.items()}
    return {
        "built": built,
        "peak": seen.peak,
        "gathered": held_whole[0],
        "compared": compared,
        "differing": differing,
        "log": log,
        "comm": comm,
        "comm_complete": stats.complete,
    }


def train(rank: int, world_size: int, engine: str, argv: list[str]) -> list[dict[str, float]]:
    """The recipe's ``main`` on this rank; rank 0's log."""
    torch.set_num_threads(1)
    log: list[dict[str, float]] = recipe(engine).main(argv)
    return log
