"""Run several ``torchrun`` agents on this machine as if each were a node, and always clean up.

:class:`Nodes` starts one agent per "node" with the same c10d rendezvous endpoint on 127.0.0.1,
reads every line they (and their workers) print with the time it arrived, and on leaving its
``with`` block, however it is left, kills every process it ever saw: the agents, and the
workers, which torchrun starts in sessions of their own (so killing an agent's process group
does not reach them) and which outlive an agent killed first. Processes are tracked as
``psutil.Process`` objects, which refuse to signal a recycled pid.

The rendezvous port is chosen free and held by the first agent, which is told to host the
store (``is_host=1``; the others ``is_host=0``): if another process takes the port in between,
that agent fails at once with "address already in use" and :func:`run_nodes` tries another
port, instead of every agent connecting to a stranger and waiting out a timeout. Workers meet
on a second store that the hosting agent binds to port 0 (torch's default), which cannot clash.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import psutil

from fsdp_guide.launcher import find_free_port

ROOT = Path(__file__).resolve().parents[2]
_PORT_TAKEN = ("Address already in use", "EADDRINUSE")
_T = TypeVar("_T")


@dataclass
class Agent:
    """One torchrun agent: its process and every line it printed, as (seconds, text)."""

    node: int
    process: subprocess.Popen[str]
    lines: list[tuple[float, str]] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "".join(text for _, text in self.lines)


def torchrun_command(
    script: str | Path,
    args: Sequence[str],
    *,
    nnodes: int,
    node: int,
    nproc: int,
    port: int,
    max_restarts: int = 0,
) -> list[str]:
    """The torchrun command line of one node (the rendezvous hosted by node 0)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes), "--node-rank", str(node), "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1",
        "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
        str(script), *args,
    ]  # fmt: skip


class Nodes:
    """``nnodes`` torchrun agents running ``script``; a context manager that kills them all.

    Args:
        script: The training script, as torchrun runs it.
        args: Its arguments.
        nnodes: Agents ("nodes").
        nproc: Workers per agent.
        port: The rendezvous port.
        max_restarts: torchrun's ``--max-restarts``.
        env: Extra environment variables for the agents and their workers.
    """

    def __init__(
        self,
        script: str | Path,
        args: Sequence[str],
        *,
        nnodes: int,
        nproc: int,
        port: int,
        max_restarts: int = 0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port
        self.started = time.monotonic()
        self.started_wall = time.time()  # to place file times on the same clock
        self.agents: list[Agent] = []
        self._seen: dict[int, psutil.Process] = {}
        self.agent_of: dict[int, int] = {}  # pid of every worker seen -> its agent's node
        self._lock = threading.Lock()
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            self._start(script, args, nnodes, nproc, port, max_restarts, full_env)
        except BaseException:
            self.close()
            raise

    def _start(
        self,
        script: str | Path,
        args: Sequence[str],
        nnodes: int,
        nproc: int,
        port: int,
        max_restarts: int,
        full_env: dict[str, str],
    ) -> None:
        for node in range(nnodes):
            command = torchrun_command(
                script, args, nnodes=nnodes, node=node, nproc=nproc, port=port,
                max_restarts=max_restarts,
            )  # fmt: skip
            process = subprocess.Popen(
                command, cwd=ROOT, env=full_env, text=True, start_new_session=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            agent = Agent(node, process)
            self.agents.append(agent)
            self._seen[process.pid] = psutil.Process(process.pid)
            threading.Thread(target=self._read, args=(agent,), daemon=True).start()
        # Workers can start and end while the caller is busy: look for them all the time.
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while any(a.process.poll() is None for a in self.agents):
            self.workers()
            time.sleep(0.05)

    def _read(self, agent: Agent) -> None:
        assert agent.process.stdout is not None
        for text in agent.process.stdout:
            with self._lock:
                agent.lines.append((time.monotonic() - self.started, text))

    def lines(self) -> list[tuple[float, str]]:
        """Every line of every agent so far, in the order they arrived."""
        with self._lock:
            return sorted(line for agent in self.agents for line in agent.lines)

    def output(self) -> str:
        return "".join(f"[{t:7.2f}] {text}" for t, text in self.lines())

    def workers(self) -> list[psutil.Process]:
        """The agents' live descendants (their workers), remembered for the cleanup."""
        found = []
        for agent in self.agents:
            try:
                children = psutil.Process(agent.process.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            with self._lock:
                for proc in children:
                    self.agent_of.setdefault(proc.pid, agent.node)
                    self._seen.setdefault(proc.pid, proc)
            found += children
        return found

    def wait(self, timeout: float, grace: float = 20.0) -> list[int]:
        """Wait for every agent to exit; their exit codes. Raises on timeout, with the output.

        Once an agent has failed, the others get ``grace`` seconds to notice, then are killed
        (an agent waiting for a rendezvous host that never came would wait minutes); at once
        when the rendezvous port was taken.
        """
        deadline = self.started + timeout
        failed_at: float | None = None
        while any(a.process.poll() is None for a in self.agents):
            now = time.monotonic()
            if failed_at is None and any(a.process.poll() not in (None, 0) for a in self.agents):
                failed_at = now
            if failed_at is not None and (now > failed_at + grace or self.port_taken()):
                self.close()
                return [a.process.returncode for a in self.agents]
            if now > deadline:
                raise AssertionError(
                    f"torchrun agents still running after {timeout:g} s:\n{self.output()}"
                )
            self.workers()
            time.sleep(0.05)
        for agent in self.agents:  # the readers finish once the pipes close
            agent.process.communicate(timeout=10)
        return [a.process.returncode for a in self.agents]

    def port_taken(self) -> bool:
        """Whether an agent failed because another process held the rendezvous port."""
        return any(marker in self.output() for marker in _PORT_TAKEN)

    def wait_for(self, predicate: str | Path, timeout: float) -> float:
        """Wait until a line contains ``predicate`` (a ``str``) or a file exists (a ``Path``)."""
        deadline = self.started + timeout
        while True:
            if isinstance(predicate, Path) and predicate.exists():
                return time.monotonic() - self.started
            if isinstance(predicate, str) and any(predicate in t for _, t in self.lines()):
                return time.monotonic() - self.started
            ended = all(a.process.poll() is not None for a in self.agents)
            if ended or time.monotonic() > deadline:
                raise AssertionError(f"never saw {predicate!r}:\n{self.output()}")
            self.workers()
            time.sleep(0.02)

    def close(self) -> None:
        """Kill every agent and worker ever seen, and reap the agents."""
        for agent in self.agents:  # stopped first, so that none starts a worker meanwhile
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent.process.pid, signal.SIGSTOP)
        self.workers()
        with self._lock:
            seen = list(self._seen.values())
        for proc in seen:
            try:
                proc.send_signal(signal.SIGKILL)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        psutil.wait_procs(seen, timeout=10)
        for agent in self.agents:
            try:
                agent.process.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                agent.process.kill()

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Job:
    """A script for :func:`run_together` to run on ``nnodes`` agents of ``nproc`` workers."""

    script: str | Path
    args: tuple[str, ...] = ()
    nnodes: int = 2
    nproc: int = 2
    max_restarts: int = 0
    env: dict[str, str] = field(default_factory=dict, hash=False)


def run_together(
    jobs: Sequence[Job],
    *,
    during: Callable[[], _T] | None = None,
    timeout: float = 180.0,
    attempts: int = 3,
) -> tuple[list[Nodes], _T | None]:
    """Run the jobs at once, each on its own agents and port, and ``during()`` meanwhile.

    Running them together overlaps their idle stretches (agents meeting, processes exiting)
    on a machine with few cores. Each job must succeed; a job whose rendezvous port another
    process took first runs again on a fresh one. ``during`` runs once, in this process.

    Returns:
        The finished runs, in the order of ``jobs``, and what ``during`` returned.
    """
    finished: dict[int, Nodes] = {}
    result: _T | None = None
    for _ in range(attempts):
        with ExitStack() as stack:
            running = {
                i: stack.enter_context(
                    Nodes(job.script, job.args, nnodes=job.nnodes, nproc=job.nproc,
                          port=find_free_port(), max_restarts=job.max_restarts, env=job.env)
                )
                for i, job in enumerate(jobs)
                if i not in finished
            }  # fmt: skip
            if during is not None:
                result, during = during(), None
            codes = {i: nodes.wait(timeout) for i, nodes in running.items()}
        for i, nodes in running.items():
            if codes[i] == [0] * jobs[i].nnodes:
                finished[i] = nodes
            elif not nodes.port_taken():
                raise AssertionError(f"exit codes {codes[i]}:\n{nodes.output()}")
        if len(finished) == len(jobs):
            return [finished[i] for i in range(len(jobs))], result
    raise AssertionError(f"no free rendezvous port in {attempts} tries")


def run_nodes(
    script: str | Path,
    args: Sequence[str],
    *,
    nnodes: int = 2,
    nproc: int = 2,
    timeout: float = 120.0,
    attempts: int = 3,
) -> Nodes:
    """Run ``script`` on ``nnodes`` agents to the end, checked for success; the finished run."""
    runs, _ = run_together(
        [Job(script, tuple(args), nnodes, nproc)], timeout=timeout, attempts=attempts
    )
    return runs[0]
