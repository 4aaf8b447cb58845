"""FSDP2 across nodes: shard within each node, replicate across nodes (HSDP).

A 2-D device mesh ``(replicate, shard)`` gives each rank two process groups: its *shard group*,
the ranks of its own node, over which ``fully_shard`` splits parameters, gradients and
optimizer state; and its *replicate group*, one rank per node holding the same shard. Each
step all-gathers parameters and reduce-scatters gradients inside the shard group, then
all-reduces each gradient shard across the replicate group: only that all-reduce leaves the
node. The script prints where each rank runs, its groups, the losses, the bytes of model
state a rank holds, and what every collective of one step moved, per group.

On two nodes (the same command on each; HOST is the first node)::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 examples/fsdp2_hsdp.py

On one machine, as two "nodes" of two ranks (``launch`` starts them)::

    python examples/fsdp2_hsdp.py --world-size 4 --shard-size 2
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fsdp2_train import Model, batch, loss_of  # the plain script, beside this one
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_guide import launch
from fsdp_guide.launcher import rank_device
from fsdp_guide.memory import measure_model_state


class CollectivesByGroup(TorchDispatchMode):
    """Count every collective this thread issues, per process group (named by its ranks).

    ``counts[ranks][kind]`` is ``[calls, payload bytes]``; the payload is the whole tensor a
    collective works on (the gathered output of an all-gather, the input of a reduce-scatter,
    the tensor all-reduced), as :func:`fsdp_guide.memory.count_collectives` counts it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[tuple[int, ...], dict[str, list[int]]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d" and func._opname != "barrier":
            group = next((g for a in args if (g := _as_group(a)) is not None), None)
            if group is not None:
                ranks = tuple(dist.get_process_group_ranks(group))
                entry = self.counts.setdefault(ranks, {}).setdefault(_kind(func._opname), [0, 0])
                entry[0] += 1
                entry[1] += max(_bytes(args[0]), _bytes(args[1]) if len(args) > 1 else 0)
        return func(*args, **(kwargs or {}))


def _kind(opname: str) -> str:
    """``"_allgather_base_"``, ``"allgather_into_tensor_coalesced_"`` -> ``"all_gather"``."""
    kind = opname.strip("_")
    for suffix in ("_base", "_coalesced", "_into_tensor", "_tensor"):
        kind = kind.removesuffix(suffix)
    return {"allgather": "all_gather", "allreduce": "all_reduce"}.get(kind, kind)


def _as_group(arg: Any) -> dist.ProcessGroup | None:
    if type(arg).__name__ != "ScriptObject":
        return None
    try:
        return dist.ProcessGroup.unbox(arg)
    except RuntimeError:  # another script object: a ReduceOp
        return None


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_bytes(v) for v in value)
    return 0


def train(rank: int, world_size: int, steps: int, shard_size: int) -> dict[str, Any]:
    """Train ``steps`` steps, sharded within groups of ``shard_size``, replicated across them.

    Returns what this rank measured: where it runs, its groups, the losses, the bytes of model
    state it holds, and its collectives of the last step, per group.
    """
    device = rank_device()
    replicas = world_size // shard_size
    if replicas == 1:
        # Plain FSDP2 over every rank. (A (1, N) mesh would not be quite that: FSDP2 still
        # all-reduces each gradient shard over its one-rank replicate group.)
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    else:
        # Rows of the mesh are shard groups: ranks GROUP_RANK * LOCAL_WORLD_SIZE + 0, 1, ...,
        # the ranks torchrun starts on one node, when shard_size is the ranks per node.
        mesh = init_device_mesh(
            device.type, (replicas, shard_size), mesh_dim_names=("replicate", "shard")
        )
    torch.manual_seed(0)
    model = Model().to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    losses = []
    for step in range(steps):
        counter = CollectivesByGroup()
        with counter:  # one step's collectives (the last step's are kept)
            loss = loss_of(model, batch(step, rank, world_size, device))
            loss.backward()
            optimizer.step()
        state = measure_model_state(model, optimizer)
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return {
        "rank": rank,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node": int(os.environ.get("GROUP_RANK", 0)),  # torchrun's node index
        "pid": os.getpid(),
        "shard_group": dist.get_process_group_ranks(mesh.get_group("shard")),
        "replicate_group": (
            dist.get_process_group_ranks(mesh.get_group("replicate")) if replicas > 1 else [rank]
        ),
        "losses": losses,
        "model_state": state.as_dict(),
        "collectives": [
            {"ranks": list(ranks), "kind": kind, "calls": calls, "bytes": nbytes}
            for ranks, kinds in sorted(counter.counts.items())
            for kind, (calls, nbytes) in sorted(kinds.items())
        ],
    }


def show(results: list[dict[str, Any]]) -> None:
    """Print the layout, the losses and rank 0's collectives of one step."""
    node = {r["rank"]: r["node"] for r in results}
    for r in results:
        print(
            f"rank {r['rank']}: node {r['node']}, local rank {r['local_rank']}, pid {r['pid']}, "
            f"shard group {r['shard_group']}, replicate group {r['replicate_group']}"
        )
    for step, loss in enumerate(results[0]["losses"], 1):
        print(f"step {step}: loss {loss:.6f}")
    print(f"model state of rank 0: {results[0]['model_state']['total']:,} bytes")
    for c in results[0]["collectives"]:
        where = "within node" if len({node[r] for r in c["ranks"]}) == 1 else "across nodes"
        print(
            f"rank 0, one step, group {c['ranks']} ({where}): "
            f"{c['kind']} x{c['calls']}, {c['bytes']:,} bytes"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=4, help="ranks (ignored under torchrun)")
    parser.add_argument(
        "--shard-size", type=int, default=None, help="ranks per shard group (default: per node)"
    )
    parser.add_argument("--json", default=None, help="also write every rank's results here")
    args = parser.parse_args()
    # Under torchrun, LOCAL_WORLD_SIZE is the ranks per node; started here, 2.
    shard_size = args.shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", 2))
    results = launch(train, world_size=args.world_size, args=(args.steps, shard_size))
    if int(os.environ.get("RANK", 0)) == 0:  # under torchrun every rank gets the list
        show(results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
