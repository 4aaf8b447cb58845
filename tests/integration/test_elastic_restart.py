"""torchrun restarts a two-node job after a rank dies, and the training resumes to the same losses.

Two agents (one rank each) run ``examples/fsdp2_train_elastic.py`` with ``--max-restarts 3``,
through ``tests/helpers/elastic_faults.py``, which injects two faults, each once:

1. rank 1 stops after its third optimizer step and this test kills it with SIGKILL; both
   agents restart their ranks, which resume from the checkpoint of step 2;
2. in the next start, rank 1 kills itself inside the save of step 6, after writing its shards
   and before the checkpoint is published; the ranks resume from step 4, the last complete
   checkpoint, and nothing of the interrupted save is loaded.

The losses of every step, after both restarts, equal an uninterrupted run's, digit for digit.
The test prints the time each restart cost and the steps trained again.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from elastic_faults import PAUSE_STEP
from torchrun_nodes import ROOT, Nodes

from fsdp_guide import launch
from fsdp_guide.launcher import find_free_port

sys.path.insert(0, str(ROOT / "examples"))
import fsdp2_train_elastic

FAULTS = ROOT / "tests" / "helpers" / "elastic_faults.py"
STEPS, SAVE_EVERY = 8, 2
START = re.compile(r"start \d+: from step (\d+)")
LOSS = re.compile(r"step (\d+): loss ([0-9.]+)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_killed_ranks_restart_and_resume_to_the_uninterrupted_losses(tmp_path: Path) -> None:
    faults, ckpt = tmp_path / "faults", tmp_path / "ckpt"
    faults.mkdir()
    args = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--checkpoint-dir", str(ckpt)]
    env = {"ELASTIC_FAULTS": str(faults)}
    with Nodes(
        FAULTS, args, nnodes=2, nproc=1, port=find_free_port(), max_restarts=3, env=env
    ) as nodes:
        # Meanwhile, the same training without faults, forked from here.
        uninterrupted = launch(
            fsdp2_train_elastic.train,
            2,
            args=(STEPS, SAVE_EVERY, str(tmp_path / "straight")),
            start_method="fork",
        )[0]
        nodes.wait_for(faults / "paused", timeout=120)
        paused = int((faults / "paused").read_text())
        [victim] = [w for w in nodes.workers() if w.pid == paused]  # a rank of this job
        killed_at = time.monotonic() - nodes.started
        victim.kill()  # SIGKILL
        codes = nodes.wait(timeout=240)
    assert codes == [0, 0], nodes.output()
    in_save = faults / "killed-in-save"
    assert in_save.exists(), "the second fault never fired:\n" + nodes.output()
    died_in_save_at = in_save.stat().st_mtime - nodes.started_wall

    lines = [(t, text.strip()) for t, text in nodes.lines()]
    starts = [(t, int(m[1])) for t, text in lines if (m := START.fullmatch(text))]
    assert [step for _, step in starts] == [0, 2, 4], nodes.output()
    printed = [(t, int(m[1]), m[2]) for t, text in lines if (m := LOSS.fullmatch(text))]
    last: dict[int, str] = {}
    for _, step, loss in printed:
        assert last.get(step, loss) == loss, f"step {step} redone to another loss"
        last[step] = loss

    # Nothing of the interrupted save was loaded, and the next save cleared it away.
    interrupted = in_save.read_text()
    assert interrupted.startswith("data-") and not (ckpt / interrupted).exists()
    assert len([p for p in ckpt.iterdir() if p.name.startswith("data-")]) == 1

    assert [last[s] for s in range(1, STEPS + 1)] == [f"{x:.6f}" for x in uninterrupted]

    # The figures: time from each failure to the first step trained after it, steps redone.
    first_step_after = [min(t for t, step, _ in printed if t > s) for s, _ in starts[1:]]
    faults_at = (killed_at, died_in_save_at)
    lost = [after - fault for after, fault in zip(first_step_after, faults_at, strict=True)]
    redone = [PAUSE_STEP - 2, 6 - 4]
    print(
        f"\nrestart after SIGKILL: {lost[0]:.1f} s to the next step, {redone[0]} step redone; "
        f"after a death in a save: {lost[1]:.1f} s, {redone[1]} steps redone"
    )
    assert all(x > 0 for x in lost)
