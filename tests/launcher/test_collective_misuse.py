"""Collectives misused across ranks are reported within seconds, and slow ranks are not.

Before, each of these waited for the launch timeout (300 s by default). The hang watch
needs every rank idle in a collective for about 4 s, so each mistake here must be reported
in well under the 60 s timeout the tests set; the nested launch fails at its 5 s entry check.
"""

from __future__ import annotations

import subprocess
import sys
import time

import collective_targets as targets
import pytest

from fsdp_guide import RankError, launch
from fsdp_guide.errors import CollectiveCallError, CollectiveMismatchError, LaunchError

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 60.0
# Quiet 2 s, probe, confirm 2 s later, on a shared machine: well under the timeout.
REPORTED_WITHIN_S = 30.0


@pytest.mark.parametrize(
    ("fn", "calls"),
    [
        (targets.swapped_order, {0: "all_reduce", 1: "broadcast"}),
        (targets.barrier_on_rank_zero_only, {0: "barrier", 1: "all_reduce"}),
        (targets.object_against_tensor, {0: "broadcast_object_list", 1: "all_reduce"}),
    ],
    ids=["swapped-order", "barrier-on-one-rank", "object-vs-tensor"],
)
def test_ranks_waiting_in_different_collectives_are_reported_fast(
    fn: object, calls: dict[int, str], capfd: pytest.CaptureFixture[str]
) -> None:
    t0 = time.monotonic()
    with pytest.raises(CollectiveMismatchError) as info:
        launch(fn, 2, backend="gloo", start_method="fork", timeout=TIMEOUT_S)  # type: ignore[arg-type]
    elapsed = time.monotonic() - t0
    assert elapsed < REPORTED_WITHIN_S, elapsed
    err = info.value
    assert isinstance(err, LaunchError) and isinstance(err, CollectiveCallError)
    assert {rank: call.split(",")[0] for rank, call in err.calls.items()} == calls
    assert all("collective_targets.py, line" in call for call in err.calls.values())
    assert "same order" in str(err)
    stderr = capfd.readouterr().err
    assert "[rank0]" in stderr and "[rank1]" in stderr and "collective_targets.py" in stderr


@pytest.mark.parametrize("how", ["sleep", "compute"])
def test_a_slow_rank_is_not_a_mismatch(how: str) -> None:
    # Rank 0 waits in a barrier for 7 s while rank 1 sleeps or computes, longer than the
    # watch's quiet and confirm periods together: no false alarm, the launch succeeds.
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 if how == "compute" else 0)
    ]
    try:
        assert launch(
            targets.slow_peer,
            2,
            args=(how, 7.0),
            backend="gloo",
            start_method="fork",
            timeout=TIMEOUT_S,
        ) == [0, 1]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_launch_on_one_rank_only_fails_at_its_entry_naming_the_mistake() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError, match="CollectiveCallError") as info:
        launch(
            targets.launch_on_rank_zero_only,
            2,
            args=(120.0,),  # rank 1 busy for longer than the test's patience
            backend="gloo",
            start_method="fork",
            timeout=TIMEOUT_S,
        )
    elapsed = time.monotonic() - t0
    assert elapsed < REPORTED_WITHIN_S, elapsed
    message = str(info.value)
    assert info.value.rank == 0
    assert "fsdp_guide.launch is collective" in message
    assert "`if rank == 0:`" in message and "ranks [1] did not" in message
