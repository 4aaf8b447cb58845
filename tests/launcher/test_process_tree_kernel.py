"""In a real Jupyter kernel: what launched ranks start dies with the ranks, however they end.

A notebook-defined function runs on two forked ranks; each rank starts the helpers of
``tree_targets`` (a plain child, one ignoring SIGTERM, one in its own session, a daemon
that double-forks away) and blocks. Then the kernel is interrupted, restarted or SIGKILLed,
as a front end or the OOM killer would. Every process below the kernel must be gone within
a few seconds, and the kernel (or its replacement) must still answer.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

jupyter_client = pytest.importorskip("jupyter_client")

pytestmark = pytest.mark.timeout(240)

HELPERS = Path(__file__).parents[1] / "helpers"
GONE_WITHIN_S = 5.0

_CELL = textwrap.dedent(
    """\
    import sys
    sys.path.insert(0, {helpers!r})
    import tree_targets
    from fsdp_guide import launch

    def train(rank, world_size, directory):  # defined here: the ranks are forked
        return tree_targets.helpers_then_block(rank, world_size, directory)

    launch(train, 2, args=({directory!r},), backend="gloo", timeout=200)
    """
)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def kernel() -> Iterator[tuple[Any, Any]]:
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _launch_and_collect(km: Any, kc: Any, directory: Path) -> tuple[str, dict[str, int]]:
    """Run the launching cell (no reply awaited); every pid below the kernel once it blocks."""
    msg_id: str = kc.execute(_CELL.format(helpers=str(HELPERS), directory=str(directory)))
    files = [directory / f"helpers-rank{r}.json" for r in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(f.exists() for f in files):
        assert time.monotonic() < deadline, "the ranks never started their helpers"
        time.sleep(0.05)
    pids: dict[str, int] = {}
    for rank, f in enumerate(files):
        pids.update({f"rank{rank}.{k}": p for k, p in json.loads(f.read_text()).items()})
    kernel = psutil.Process(km.provisioner.pid)
    pids.update({f"pid{p.pid}": p.pid for p in kernel.children(recursive=True)})
    assert len(set(pids.values())) >= 2 * 6, pids  # 2 ranks x (rank + 5 helpers)
    return msg_id, pids


def _survivors(pids: dict[str, int]) -> dict[str, int]:
    deadline = time.monotonic() + GONE_WITHIN_S
    while (alive := {k: p for k, p in pids.items() if _alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _kill(pids: dict[str, int]) -> None:
    for pid in pids.values():
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _reply(kc: Any, msg_id: str, seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while True:
        reply: dict[str, Any] = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]


def test_a_sigkilled_kernel_leaves_nothing_below_it(
    kernel: tuple[Any, Any], tmp_path: Path
) -> None:
    km, kc = kernel
    pids: dict[str, int] = {}
    try:
        _, pids = _launch_and_collect(km, kc, tmp_path)
        os.kill(km.provisioner.pid, signal.SIGKILL)
        assert _survivors(pids) == {}, "alive after the kernel was SIGKILLed"
    finally:
        _kill(pids)


def test_interrupt_then_restart_leave_nothing_below_the_kernel(
    kernel: tuple[Any, Any], tmp_path: Path
) -> None:
    km, kc = kernel
    pids: dict[str, int] = {}
    try:
        (tmp_path / "a").mkdir()
        msg_id, pids = _launch_and_collect(km, kc, tmp_path / "a")
        km.interrupt_kernel()
        reply = _reply(kc, msg_id, 60)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
        assert _survivors(pids) == {}, "alive after the cell was interrupted"
        assert kc.execute("40 + 2", reply=True, timeout=60)["content"]["status"] == "ok"

        (tmp_path / "b").mkdir()
        _, pids = _launch_and_collect(km, kc, tmp_path / "b")
        km.restart_kernel(now=True)
        kc.wait_for_ready(timeout=60)
        assert _survivors(pids) == {}, "alive after the kernel was restarted"
        assert kc.execute("40 + 2", reply=True, timeout=60)["content"]["status"] == "ok"
    finally:
        _kill(pids)
