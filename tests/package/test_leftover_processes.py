"""The suite's leftover-process check (tests/conftest.py) lets only MPI's singleton daemon by."""

from __future__ import annotations

import sys
import types

import psutil
import pytest
from conftest import is_mpi_singleton_daemon


class FakeProcess:
    def __init__(self, name: str, cmdline: list[str]) -> None:
        self._name, self._cmdline = name, cmdline

    def name(self) -> str:
        return self._name

    def cmdline(self) -> list[str]:
        return self._cmdline


ORTED = ["orted", "--hnp", "--set-sid", "--report-uri", "18", "--singleton-died-pipe", "19"]


@pytest.mark.parametrize(
    ("mpi_imported", "name", "cmdline", "tolerated"),
    [
        (True, "orted", ORTED, True),
        (False, "orted", ORTED, False),  # nothing here started MPI: a real leak
        (True, "orted", ["orted", "--hnp"], False),  # a daemon, but not a singleton's
        (True, "python", ["python", "rank.py"], False),
    ],
)
def test_only_the_singleton_daemon_of_an_mpi_process_is_tolerated(
    monkeypatch: pytest.MonkeyPatch,
    mpi_imported: bool,
    name: str,
    cmdline: list[str],
    tolerated: bool,
) -> None:
    if mpi_imported:
        monkeypatch.setitem(sys.modules, "mpi4py.MPI", types.ModuleType("mpi4py.MPI"))
    else:
        monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    proc: psutil.Process = FakeProcess(name, cmdline)  # type: ignore[assignment]
    assert is_mpi_singleton_daemon(proc) is tolerated
