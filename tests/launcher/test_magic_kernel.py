"""``%%distributed`` in a real Jupyter kernel that is force-restarted while its ranks run.

Jupyter restarts a kernel with SIGKILL on the kernel's process group (after a crash, the OOM
killer, or "Restart" on a busy kernel). The ranks lead process groups of their own, so only
``_orphan.py`` stops them; and the new kernel binds the same ports, which the old kernel's
forked ranks must have let go.
"""

from __future__ import annotations

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

pytestmark = pytest.mark.timeout(180)

_BLOCKING_CELL = textwrap.dedent(
    """\
    %%distributed --world-size 2 --backend gloo --timeout 150
    import os, torch, torch.distributed as dist
    with open(os.path.join({directory!r}, f"rank{{rank}}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 0:
        dist.barrier()
    else:
        dist.recv(torch.zeros(1), src=0)
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


def _run(kc: Any, code: str) -> dict[str, Any]:
    reply: dict[str, Any] = kc.execute(code, reply=True, timeout=60)
    return reply["content"]


def test_a_force_restarted_kernel_starts_again_and_leaves_no_rank(
    kernel: tuple[Any, Any], tmp_path: Path
) -> None:
    km, kc = kernel
    assert _run(kc, "%load_ext fsdp_guide")["status"] == "ok"
    kc.execute(_BLOCKING_CELL.format(directory=str(tmp_path)))  # blocks: no reply awaited
    pid_files = [tmp_path / f"rank{r}.pid" for r in (0, 1)]
    deadline = time.monotonic() + 90
    while not all(p.exists() and p.read_text() for p in pid_files):
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in pid_files]
    try:
        time.sleep(0.5)  # both ranks inside their collective
        t0 = time.monotonic()
        km.restart_kernel(now=True)
        kc.wait_for_ready(timeout=60)
        reply = _run(kc, "answer = 40 + 2\nanswer")
        elapsed = time.monotonic() - t0
        assert reply["status"] == "ok", reply
        assert elapsed < 60, elapsed
        t1 = time.monotonic()
        while any(_alive(pid) for pid in pids) and time.monotonic() - t1 < 5.0:
            time.sleep(0.05)
        assert not [pid for pid in pids if _alive(pid)], "a rank of the old kernel survived"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
