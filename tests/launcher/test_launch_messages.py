"""Errors and timeouts that read well: the rank's code first, the launcher's frames gone."""

from __future__ import annotations

import re
import time
import traceback
from pathlib import Path

import launch_targets as targets
import pytest

from fsdp_guide import RankError, launch
from fsdp_guide.errors import LaunchTimeout

pytestmark = pytest.mark.timeout(60)


def test_a_rank_error_keeps_the_ranks_traceback_and_drops_the_supervisors_frames() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(targets.raise_on, 2, args=(1,), backend="gloo", start_method="fork")
    assert time.monotonic() - t0 < 15
    shown = "".join(traceback.format_exception(info.value))
    assert "boom from rank 1" in shown
    assert 'launch_targets.py", line' in shown  # the rank's own traceback, in the message
    for machinery in ("_supervisor.py", "selectors.py", "_reports.py"):
        assert machinery not in shown


def test_stacks_on_timeout_show_the_users_frame_first_and_elide_the_machinery(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout, match="Raise `timeout=`"):
        launch(
            targets.block_in_collective,
            2,
            args=(str(tmp_path),),
            backend="gloo",
            start_method="fork",
            timeout=3,
        )
    elapsed = time.monotonic() - t0
    assert elapsed < 3 + 10, elapsed
    err = capfd.readouterr().err
    for rank in (0, 1):
        lines = [line for line in err.splitlines() if line.startswith(f"[rank{rank}] ")]
        start = next(i for i, line in enumerate(lines) if "Current thread" in line)
        block = lines[start:]
        end = next(i for i, line in enumerate(block) if "machinery elided" in line)
        assert "in block_in_collective" in block[1], block  # the user's line comes first
        assert "inside library code" in block[2], block
        elided = int(re.search(r"\((\d+) lines? of fork", block[end]).group(1))  # type: ignore[union-attr]
        assert elided >= 3, block[end]
        assert end < 10, block  # what is left fits on a screen
        assert not any("multiprocessing" in line for line in block), block
