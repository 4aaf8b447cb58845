"""What a killed save leaves behind is removed by the next save, and only that.

A full save killed half-way (SIGKILL of a real process in the middle of writing) leaves its
temporary file ``.NAME.tmp-<host>-<pid>-*``; the next save of the same target removes it,
but keeps the temporary files of writers that still run, of other hosts, and of other
targets. A sharded save killed before it removed its attempt leaves a ``data-*`` directory
that the index does not name; the next save removes it, and a load never does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_guide import checkpoint
from fsdp_guide.checkpoint import CheckpointError

# 32 Mi float32 parameters: a 128 MiB file, written for long enough to be caught half-way.
SAVE_BIG = """
import sys, torch
from torch import nn
from fsdp_guide import checkpoint
model = nn.Linear(4096, 8192, bias=False)
print("ready", flush=True)
checkpoint.save(sys.argv[1], model)
"""


def temps_of(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.tmp-*"))


def kill_mid_write(path: Path) -> Path:
    """Start a process saving to ``path``; SIGKILL it once its temporary file holds 1 MiB."""
    for _ in range(3):  # on a fast disk a save can finish between two looks: try again
        process = subprocess.Popen(
            [sys.executable, "-c", SAVE_BIG, str(path)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert process.stdout is not None and process.stdout.readline() == "ready\n"
            deadline = time.monotonic() + 120
            while process.poll() is None and time.monotonic() < deadline:
                partial = [p for p in temps_of(path) if p.stat().st_size >= 1 << 20]
                if partial:
                    process.send_signal(signal.SIGKILL)
                    process.wait()
                    return partial[0]
                time.sleep(0.001)
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()
            assert process.stdout is not None
            process.stdout.close()
        path.unlink(missing_ok=True)
    raise AssertionError("the save finished every time before it could be killed")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_temporary_file_of_a_killed_save_is_removed_by_the_next_save(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    left = kill_mid_write(path)
    assert left.exists() and not path.exists()
    print(f"left behind by the killed save: {left.stat().st_size} bytes")  # 1 MiB or more

    checkpoint.save(path, nn.Linear(2, 2), extra={"step": 1})
    assert temps_of(path) == []
    assert checkpoint.load(path, nn.Linear(2, 2)) == {"step": 1}


# Opens a temporary file named for its own pid, as a save in progress does, and keeps it open.
HOLD_OPEN = """
import os, sys, time
path = os.path.join(sys.argv[1], f".ckpt.pt.tmp-{sys.argv[2]}-{os.getpid()}-0000000a")
handle = open(path, "wb")
print(path, flush=True)
time.sleep(600)
"""


def test_only_temporary_files_whose_writer_is_gone_are_removed(tmp_path: Path) -> None:
    from fsdp_guide.checkpoint._temps import this_host

    host = this_host()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    dead = int(ended.stdout)
    live = subprocess.Popen(
        [sys.executable, "-c", HOLD_OPEN, str(tmp_path), host], stdout=subprocess.PIPE, text=True
    )
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert live.stdout is not None
        writing = Path(live.stdout.readline().strip())
        names = {
            "dead writer": f".ckpt.pt.tmp-{host}-{dead}-0000000b",
            "pid alive, file not open (pid reused)": f".ckpt.pt.tmp-{host}-{idle.pid}-0000000c",
            "earlier name, dead writer": f".ckpt.pt.tmp-{dead}-0000000d",
            "another host": f".ckpt.pt.tmp-elsewhere-{dead}-0000000e",
            "another target": f".other.pt.tmp-{host}-{dead}-0000000f",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"partial")

        checkpoint.save(tmp_path / "ckpt.pt", nn.Linear(2, 2))

        left = {p.name for p in tmp_path.iterdir()}
        assert left == {
            "ckpt.pt",
            writing.name,
            names["another host"],
            names["another target"],
        }
    finally:
        for process in (live, idle):
            process.kill()
            process.wait()
        if live.stdout is not None:
            live.stdout.close()


def test_stale_data_directories_go_on_the_next_save_not_on_a_load(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp_guide.launcher import dist_init, find_free_port

    dist_init(0, 1, master_port=find_free_port())
    try:
        model = fully_shard(nn.Linear(4, 3), mesh=init_device_mesh("cpu", (1,)))
        path = tmp_path / "ckpt"
        checkpoint.save(path, model, kind="sharded", extra={"step": 1})
        stale = path / "data-0123456789ab"  # what a save whose ranks were killed leaves
        stale.mkdir()
        (stale / "__0_0.distcp").write_bytes(b"\0" * 4096)
        index_temp = path / ".index.json.tmp-gone-999999999-0123abcd"  # another host's
        index_temp.write_bytes(b"{")

        checkpoint.load(path, nn.Linear(4, 3))
        assert stale.exists()  # a load changes nothing

        checkpoint.save(path, model, kind="sharded", extra={"step": 2})
        named = json.loads((path / "index.json").read_text())["extra"].split("/")[0]
        assert sorted(p.name for p in path.iterdir() if p.is_dir()) == [named]
        assert index_temp.exists()  # another host's writer may still be writing it
        assert checkpoint.load(path, nn.Linear(4, 3)) == {"step": 2}
    finally:
        torch.distributed.destroy_process_group()


def test_a_save_under_a_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match=r"afile is a file, not a directory"):
        checkpoint.save(tmp_path / "afile" / "ckpt.pt", nn.Linear(2, 2))
    assert os.listdir(tmp_path) == ["afile"]
