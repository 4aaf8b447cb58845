"""Functions run on launched ranks by the launcher tests (importable, so spawn works too)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist


def world_info(rank: int, world_size: int, tag: str = "", *, scale: int = 1) -> dict[str, object]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": world_size,
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "rank_sum": t.item() * scale,
        "tag": tag,
        "pid": os.getpid(),
    }


def big_result(rank: int, world_size: int, numel: int) -> tuple[torch.Tensor, bytes]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(numel, generator=g), bytes([rank]) * numel


def raise_on(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        raise ValueError(f"boom from rank {rank}")
    return rank


def fail_while_peers_wait(rank: int, world_size: int, bad_rank: int) -> int:
    """The bad rank raises; the others block in a collective that can never complete."""
    if rank == bad_rank:
        time.sleep(0.5)
        raise RuntimeError(f"rank {rank} gave up")
    dist.all_reduce(torch.ones(1))
    return rank


def exit_with(rank: int, world_size: int, bad_rank: int, code: int) -> int:
    if rank == bad_rank:
        sys.stdout.flush()
        os._exit(code)
    dist.barrier()
    return rank


def sys_exit_with(rank: int, world_size: int, bad_rank: int, code: int) -> int:
    if rank == bad_rank:
        sys.exit(code)
    dist.barrier()
    return rank


def kill_self(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return rank


def sleep_on(rank: int, world_size: int, slow_rank: int, seconds: float) -> int:
    if rank == slow_rank:
        time.sleep(seconds)
    return rank


def sleep_all(rank: int, world_size: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


def chatter(rank: int, world_size: int, lines: int, width: int) -> int:
    """Write many long lines to stdout and stderr, in small chunks, to tempt interleaving."""
    for i in range(lines):
        text = f"rank{rank}-line{i}-" + "x" * width
        for start in range(0, len(text), 7):
            sys.stdout.write(text[start : start + 7])
        sys.stdout.write("\n")
        print(f"err rank{rank} line{i}", file=sys.stderr)
    sys.stdout.write(f"rank{rank} no newline at the end")
    return rank


def unpicklable_result(rank: int, world_size: int) -> object:
    return lambda: rank


def matmul_checksum(rank: int, world_size: int) -> float:
    g = torch.Generator().manual_seed(rank)
    a = torch.randn(256, 256, generator=g)
    big = torch.zeros(10**7)
    big.add_(1)  # large enough for an OpenMP parallel region
    return float((a @ a).sum()) + float(big[0]) - 1.0


def leave_a_process_running(rank: int, world_size: int, pid_dir: str) -> int:
    """Start a process that outlives the rank and keeps the rank's stdout pipe open."""
    child = subprocess.Popen(["sleep", "60"])
    Path(pid_dir, f"rank{rank}.pid").write_text(str(child.pid))
    return rank


def linger_after_result(rank: int, world_size: int, seconds: float) -> int:
    """Return at once, but leave a non-daemon thread that keeps the process alive."""
    threading.Thread(target=time.sleep, args=(seconds,), daemon=False).start()
    return rank


def write_awkward_output(rank: int, world_size: int, long_chars: int) -> int:
    """Rank 0: one huge line; others: a character split across writes and invalid UTF-8."""
    if rank == 0:
        sys.stdout.write("a" * long_chars)
        sys.stdout.write("\nend\n")
    else:
        os.write(1, b"euro \xe2\x82")
        os.write(1, b"\xac and a bad \xff byte\n")
    return rank


def kill_self_with(rank: int, world_size: int, bad_rank: int, signum: int) -> int:
    if rank == bad_rank:
        os.kill(os.getpid(), signum)
    dist.barrier()
    return rank


def ignore_sigterm_and_sleep(rank: int, world_size: int, seconds: float) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(seconds)
    return rank


def return_a_child_only_class(rank: int, world_size: int) -> object:
    """An object of a class whose module exists in the rank only (like a class of a cell)."""
    module = types.ModuleType("module_of_the_rank_only")
    exec("class Shard:\n    pass\n", module.__dict__)
    sys.modules[module.__name__] = module
    return module.Shard()


def times_ten(rank: int, world_size: int) -> int:
    return rank * 10


def launch_inside_a_rank(rank: int, world_size: int) -> list[object]:
    from fsdp_guide import launch

    return launch(times_ten, world_size=99)  # the rank's environment says 2 ranks


def big_result_while_peer_prints(rank: int, world_size: int, numel: int, lines: int) -> object:
    if rank == 0:
        return torch.full((numel,), 7, dtype=torch.uint8)
    for i in range(lines):
        print(f"rank {rank} line {i}")
    return rank


def master_port_seen(rank: int, world_size: int) -> int:
    return int(os.environ["MASTER_PORT"])


class ShardLost(Exception):
    """An exception that refuses to be pickled, like many defined in notebooks."""

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("ShardLost cannot be pickled")


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


def raise_odd(rank: int, world_size: int, kind: str) -> int:
    if rank == 1:
        if kind == "unpicklable":
            raise ShardLost("shard 3 is gone")
        if kind == "keyboard":
            raise KeyboardInterrupt
        raise Unprintable()
    dist.barrier()
    return rank


def a_module_only_the_launcher_has() -> types.ModuleType:
    """A module that exists in this process only: a spawned rank cannot import it."""
    module = types.ModuleType("module_of_the_launcher_only")
    exec("def train(rank, world_size):\n    return rank\n", module.__dict__)
    return module


def stuck_in_all_reduce(rank: int, world_size: int) -> int:
    """Rank 0 never enters the collective that the other ranks wait in."""
    if rank == 0:
        time.sleep(120)
    else:
        dist.all_reduce(torch.ones(1))
    return rank


def block_in_collective(rank: int, world_size: int, directory: str) -> int:
    """Write this rank's pid, then block for good: rank 0 in a barrier, the others in recv."""
    Path(directory, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 0:
        dist.barrier()
    else:
        dist.recv(torch.zeros(1), src=0)
    return rank


def save_on_rank_zero_only(rank: int, world_size: int, path: str, barrier: bool) -> int:
    """The DDP tutorials' habit: rank 0 alone saves, then (maybe) every rank meets."""
    from fsdp_guide import checkpoint

    model = torch.nn.Linear(2, 2)
    if rank == 0:
        checkpoint.save(path, model)
    if barrier:
        dist.barrier()
    return rank


def load_on_rank_zero_only(rank: int, world_size: int, path: str) -> int:
    from fsdp_guide import checkpoint

    model = torch.nn.Linear(2, 2)
    checkpoint.save(path, model)
    if rank == 0:
        checkpoint.load(path, model)
    dist.barrier()
    return rank


class _Cyclic:
    """Garbage in a reference cycle: only the cycle collector frees it, on whichever thread
    happens to run the collector, unless the launcher collects first."""

    def __init__(self, marker: str) -> None:
        self.me = self
        self.marker = marker

    def __del__(self) -> None:
        where = "main" if threading.current_thread() is threading.main_thread() else "other"
        group = "group" if dist.is_initialized() else "no group"
        Path(self.marker).write_text(f"{where}, {group}")


def leave_cyclic_garbage(rank: int, world_size: int, directory: str) -> int:
    import gc

    gc.disable()  # only an explicit collection may free the cycle
    _Cyclic(f"{directory}/rank{rank}")
    return rank
