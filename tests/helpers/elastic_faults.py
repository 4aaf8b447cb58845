"""Run ``examples/fsdp2_train_elastic.py`` under torchrun with two faults, each injected once.

torchrun runs this file in every worker instead of the example; it arms the faults, then runs
the example unchanged. ``ELASTIC_FAULTS`` names a directory where each fault leaves a marker
file when it fires, so that a restarted worker does not fire it again (torchrun's
``TORCHELASTIC_RESTART_COUNT`` cannot say which start this is: it counts the restarts of each
node's agent, and an agent whose workers were only stopped because another node failed may
not count that one).

1. ``paused``: rank ``PAUSE_RANK``, after its optimizer step ``PAUSE_STEP`` of the first
   start, writes its pid into the marker and waits there, so that the test kills it from
   outside with SIGKILL at a known step.
2. ``killed-in-save``: rank ``SAVE_KILL_RANK``, in the ``SAVE_KILL_NUMBER``-th checkpoint
   save of the next start (counted within that start), writes its shards and then SIGKILLs
   itself, before the checkpoint is published: a rank dying during a save.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.optim.optimizer import register_optimizer_step_post_hook

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fsdp2_train_elastic.py"
PAUSE_RANK, PAUSE_STEP = 1, 3
SAVE_KILL_RANK, SAVE_KILL_NUMBER = 1, 2


def _fire_once(marker: Path, content: str) -> bool:
    """Create ``marker`` holding ``content``, atomically; False if it existed (fault fired)."""
    draft = marker.with_name(f".{marker.name}.{os.getpid()}")
    draft.write_text(content)
    try:
        os.link(draft, marker)  # fails if the marker exists; never seen half-written
    except FileExistsError:
        return False
    finally:
        draft.unlink()
    return True


def arm(faults: Path, rank: int) -> None:
    """Install both faults in this worker."""
    paused, in_save = faults / "paused", faults / "killed-in-save"
    first_start = not paused.exists()
    steps = 0

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        nonlocal steps
        steps += 1
        due = first_start and rank == PAUSE_RANK and steps == PAUSE_STEP
        if due and _fire_once(paused, str(os.getpid())):
            while True:  # the test's SIGKILL ends this
                time.sleep(1)

    register_optimizer_step_post_hook(after_step)

    saves = 0
    write_data = FileSystemWriter.write_data

    def write_then_die(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        nonlocal saves
        written = write_data(self, plan, planner)
        saves += 1
        second_start = paused.exists() and not first_start
        due = second_start and rank == SAVE_KILL_RANK and saves == SAVE_KILL_NUMBER
        if due and _fire_once(in_save, str(Path(self.path).name)):
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]


if __name__ == "__main__":
    torch.set_num_threads(1)
    arm(Path(os.environ["ELASTIC_FAULTS"]), int(os.environ["RANK"]))
    sys.path.insert(0, str(EXAMPLE.parent))
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")
