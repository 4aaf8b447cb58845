"""A group launched again on a store that outlived the previous one (a torchrun restart) works.

torchrun's agent serves the workers' store and keeps it across restarts, with every key the
previous start wrote. Here the test process plays the agent: it serves a store, and several
"starts" of three forked ranks each call ``launch`` in torchrun's environment against it, rank
0 arriving late in the restarts, as a restarted rank does when its node restarts last. A rank
that reads a stale address fails only when gloo makes it the side that connects (the other
side waits for a connection), about every other time per pair: three restarts of three ranks
make the failure all but certain without a fresh namespace per start.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_guide import launch
from fsdp_guide.launcher._fresh import fresh_prefix

pytestmark = pytest.mark.timeout(120)


WORLD = 3


def _sum_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _start(rank: int, port: int, late: float) -> None:
    torch.set_num_threads(1)  # forked from a process that used its OpenMP pool
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
    )  # fmt: skip
    time.sleep(late * (rank == 0))
    results = launch(_sum_ranks, timeout=10)
    os._exit(0 if results == [6.0] * WORLD else 3)


def _run_start(port: int, late: float) -> list[int | None]:
    ctx = mp.get_context("fork")
    ranks = [ctx.Process(target=_start, args=(r, port, late)) for r in range(WORLD)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=30)
    for p in ranks:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in ranks]


def test_a_restarted_group_does_not_read_the_previous_starts_addresses() -> None:
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert _run_start(agent_store.port, late=0.0) == [0] * WORLD
    # Without a fresh namespace per start, ranks 1 and 2 read rank 0's address of the start
    # before and fail to connect ("Connection refused") or wait for it forever.
    for restart in (1, 2, 3):
        assert _run_start(agent_store.port, late=0.5) == [0] * WORLD, f"restart {restart}"


def test_ranks_that_read_an_earlier_token_wait_for_this_starts_one() -> None:
    store: Any = dist.HashStore()
    old = fresh_prefix(store, 0, 1, 1.0)  # an earlier start, now gone
    prefixes: list[str] = []
    import threading

    joiner = threading.Thread(target=lambda: prefixes.append(fresh_prefix(store, 1, 2, 10.0)))
    joiner.start()
    time.sleep(0.6)  # the joiner has read the old token and found nobody answering
    leader = fresh_prefix(store, 0, 2, 10.0)
    joiner.join(timeout=10)
    assert prefixes == [leader] and leader != old


def test_a_missing_rank_times_out_with_its_number() -> None:
    store: Any = dist.HashStore()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not join"):
        fresh_prefix(store, 0, 2, 0.3)
    with pytest.raises(TimeoutError, match="rank 1 got no answer"):
        fresh_prefix(dist.HashStore(), 1, 2, 0.3)
