"""Shared fixtures: GPU skipping, a check that no test leaves a process behind, and each
test's environment variables restored after it."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; run on a GPU machine")
    for item in items:
        # The marker, not the keyword: every test under tests/gpu/ has "gpu" as a keyword.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


def _is_multiprocessing_helper(proc: psutil.Process) -> bool:
    # multiprocessing starts one resource tracker per parent on first spawn; it lives as long
    # as the parent by design and is not a rank.
    return any("multiprocessing.resource_tracker" in part for part in proc.cmdline())


def is_mpi_singleton_daemon(proc: psutil.Process) -> bool:
    """Open MPI's daemon of this process, started when ``mpi4py.MPI`` was imported here.

    Importing ``mpi4py.MPI`` initialises MPI; a process not started by ``mpirun`` (a
    singleton) then forks ``orted --hnp ... --singleton-died-pipe N``, which serves it until
    it exits (it watches that pipe for its death). Lightning imports it wherever mpi4py is
    installed, to ask whether it runs under MPI. It is no rank, and only a process that has
    imported ``mpi4py.MPI`` can have one.
    """
    if "mpi4py.MPI" not in sys.modules:
        return False
    try:
        return proc.name() == "orted" and "--singleton-died-pipe" in proc.cmdline()
    except psutil.Error:
        return False


def live_children() -> list[psutil.Process]:
    """Child processes of this test process still running (zombies, mp helpers and MPI's
    singleton daemon excluded)."""
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if (
                child.status() != psutil.STATUS_ZOMBIE
                and not _is_multiprocessing_helper(child)
                and not is_mpi_singleton_daemon(child)
            ):
                alive.append(child)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """Fail a test that leaves any child process running after it returns."""
    before = {p.pid for p in live_children()}
    yield
    deadline = time.monotonic() + 5.0
    leftover = [p for p in live_children() if p.pid not in before]
    while leftover and time.monotonic() < deadline:
        time.sleep(0.1)
        leftover = [p for p in live_children() if p.pid not in before]
    assert not leftover, f"processes left behind: {[(p.pid, p.name()) for p in leftover]}"


@pytest.fixture(autouse=True)
def environment_restored() -> Iterator[None]:
    """Put back the environment a test found: Lightning's strategies write ``MASTER_PORT``,
    ``RANK`` and ``WORLD_SIZE`` into this process, and a later ``launch`` would read them as
    a rendezvous it was told to use (a port long gone, or a torchrun it is not under)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
