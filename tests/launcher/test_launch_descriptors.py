"""A launch lets go of its descriptors when it ends, failed or not, without waiting for GC.

A failed launch's traceback keeps its rank objects in reference cycles (a kernel keeps the
last traceback too), so pipes and process sentinels closed only by finalizers piled up:
71 -> 127 open descriptors after 50 failing launches in one kernel.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import launch_targets as targets
import pytest

from fsdp_guide import RankError, launch

pytestmark = pytest.mark.timeout(300)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def no_garbage_collection() -> Iterator[None]:
    # Collections would hide the leak; nothing here depends on them.
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
@pytest.mark.parametrize(("start_method", "launches"), [("fork", 20), ("spawn", 3)])
@pytest.mark.usefixtures("no_garbage_collection")
def test_failing_launches_leave_the_descriptor_count_unchanged(
    start_method: str, launches: int
) -> None:
    def fail() -> None:
        with pytest.raises(RankError):  # rank 1 raises ValueError
            launch(targets.raise_on, 2, args=(1,), backend="gloo", start_method=start_method)  # type: ignore[arg-type]

    fail()  # first launch: imports, the resource tracker under spawn
    before = _open_fds()
    for _ in range(launches):
        fail()
    assert _open_fds() - before <= 1, (before, _open_fds())


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
@pytest.mark.usefixtures("no_garbage_collection")
def test_successful_launches_leave_the_descriptor_count_unchanged() -> None:
    launch(targets.times_ten, 2, backend="gloo", start_method="fork")
    before = _open_fds()
    for _ in range(10):
        assert launch(targets.times_ten, 2, backend="gloo", start_method="fork") == [0, 10]
    # launch returns once every rank has exited: nothing of it stays open.
    assert _open_fds() - before <= 1, (before, _open_fds())
