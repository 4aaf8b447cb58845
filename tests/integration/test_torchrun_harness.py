"""The two-node harness picks another port when its rendezvous port is taken, and leaves no
process behind when a run fails: the agents, and the workers in their own sessions."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import psutil
import pytest
import torchrun_nodes
from torchrun_nodes import Nodes, run_nodes

pytestmark = pytest.mark.timeout(120)


def test_a_taken_port_is_retried_and_a_failed_run_is_killed_to_the_last_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "hang.py"  # a worker that never ends, and imports nothing heavy
    script.write_text("import time\nprint('worker up', flush=True)\ntime.sleep(600)\n")
    runs: list[Nodes] = []
    real_wait = Nodes.wait

    def wait(self: Nodes, timeout: float, grace: float = 20.0) -> Any:
        runs.append(self)
        if self.port == squatted:
            return real_wait(self, timeout, grace)
        # The run on a free port hangs: once its workers are up, fail as a timeout would.
        self.wait_for("worker up", timeout=60)
        raise AssertionError("still running")

    monkeypatch.setattr(Nodes, "wait", wait)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        squatted = squatter.getsockname()[1]
        ports = iter([squatted, torchrun_nodes.find_free_port()])
        monkeypatch.setattr(torchrun_nodes, "find_free_port", lambda: next(ports))
        with pytest.raises(AssertionError, match="still running"):
            run_nodes(script, [], nnodes=1, nproc=2, timeout=60)  # one agent: cheaper
    taken, hung = runs
    assert taken.port_taken() and not hung.port_taken()
    workers = list(hung.agent_of)
    assert len(workers) == 2  # each in a session of its own
    everyone = [a.process.pid for a in taken.agents + hung.agents] + workers
    assert not [pid for pid in everyone if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
