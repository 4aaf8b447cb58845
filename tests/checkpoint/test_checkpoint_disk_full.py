"""A save that runs out of space says so, and leaves nothing behind, whichever rank fails first.

Two real faults, no mocks of the write path:

* A disk that fills: a 3 MiB tmpfs mounted in a private mount namespace (``unshare``, as
  root or through a user namespace), into which a 3.3 MiB model is saved. The kernel returns
  ENOSPC from ``write``, which ``torch.save`` used to report as ``[enforce fail at
  inline_container.cc] unexpected pos``.
* A file size limit (``RLIMIT_FSIZE``, what ``ulimit -f`` sets) on one rank only, so that
  the rank that fails first is chosen: the kernel returns EFBIG from its ``write``.

A failed sharded save used to leave its ``data-*`` directory when the launcher stopped rank 0
(the one that removed it, in a ``finally``) because another rank had already raised: here
rank 0's deletes are made slow, as on network storage, to give that race its worst case.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from checkpoint_helpers import build, train

from fsdp_guide import RankError, checkpoint, launch
from fsdp_guide.checkpoint import CheckpointError

HELPERS = Path(__file__).parents[1] / "helpers"


def _namespace_command() -> list[str] | None:
    """``unshare`` arguments that give a private mount namespace here, or None."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return None
    as_user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    command = ["unshare", *as_user, "--mount", "--propagation", "private"]
    probe = subprocess.run([*command, "true"], capture_output=True, timeout=60, check=False)
    return command if probe.returncode == 0 else None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_is_named_and_nothing_is_left(tmp_path: Path) -> None:
    namespace = _namespace_command()
    if namespace is None:
        pytest.skip("no private mount namespace here (unshare refused): no small disk to fill")
    mount = tmp_path / "small-disk"
    mount.mkdir()
    # 13 layers of 256 x 256 (3.3 MiB), saved in full, then sharded three times.
    script = 'mount -t tmpfs -o size=3m tmpfs "$1" && exec "$2" "$3" "$1" 13 3'
    started = time.monotonic()
    done = subprocess.run(
        [*namespace, "sh", "-c", script, "sh", str(mount), sys.executable,
         str(HELPERS / "full_disk_run.py")],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{time.monotonic() - started:.1f} s; {json.dumps(result)[:2000]}")

    full = result["full"]
    assert full["error"].startswith(f"no space left on the device holding {mount} (ENOSPC")
    needed = int(re.search(r"takes about ([\d,]+) bytes", full["error"])[1].replace(",", ""))
    assert needed >= 13 * 257 * 256 * 4  # the model's weights and biases
    assert re.search(r"[\d,]+ of [\d,]+ bytes are free there", full["error"])
    assert full["left"] == []  # no temporary file
    for attempt in result["sharded"]:
        assert "no space left on the device holding" in attempt["error"]
        assert "unexpected pos" not in attempt["error"]
        named = attempt["named"]
        assert attempt["left"] == sorted(
            [named, f"{named}/.metadata", f"{named}/__0_0.distcp", f"{named}/__1_0.distcp",
             f"{named}/extra.pt", "index.json"]
        )  # fmt: skip
        assert attempt["extra"] == {"step": 1}  # the previous checkpoint loads


def save_then_fail(rank: int, world_size: int, path: str, failing: int) -> None:
    """Save once; then save again with a file size limit on rank ``failing``."""
    import resource

    model, optimizer = build("fsdp2", seed=0)
    train(model, optimizer, start=0, steps=1)
    checkpoint.save(path, model, optimizer, kind="sharded", extra={"step": 1})
    if rank == 0:
        real_rmtree = shutil.rmtree

        def slow_rmtree(*args: Any, **kwargs: Any) -> None:  # network storage
            time.sleep(1.0)
            real_rmtree(*args, **kwargs)

        shutil.rmtree = slow_rmtree  # type: ignore[assignment]  # this forked rank only
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == failing:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        checkpoint.save(path, model, optimizer, kind="sharded", extra={"step": 2})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("failing", [0, 1])
def test_a_failed_sharded_save_leaves_nothing_whichever_rank_fails(
    tmp_path: Path, failing: int
) -> None:
    path = tmp_path / "ckpt"
    with pytest.raises(RankError) as raised:
        launch(save_then_fail, 2, args=(str(path), failing), backend="gloo", start_method="fork")
    message = str(raised.value)
    assert f"rank {failing}: " in message
    assert "grew past this process's file size limit of 4,096 bytes (ulimit -f)" in message
    named = json.loads((path / "index.json").read_text())["extra"].split("/")[0]
    assert sorted(p.name for p in path.iterdir()) == [named, "index.json"]
    fresh, fresh_optimizer = build("module", seed=1)
    assert checkpoint.load(path, fresh, fresh_optimizer) == {"step": 1}


def save_full_with_a_limit(rank: int, world_size: int, path: str) -> str:
    import resource

    model, _ = build("module", seed=0)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, limits[1]))
    try:
        checkpoint.save(path, model)
    except CheckpointError as exc:
        return str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    return "saved"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_file_size_limit_is_named_for_a_full_save(tmp_path: Path) -> None:
    path = tmp_path / "full.pt"
    [message] = launch(save_full_with_a_limit, 1, args=(str(path),), start_method="fork")
    assert message.startswith(
        "full.pt grew past this process's file size limit of 8,192 bytes (ulimit -f) (EFBIG"
    ), message
    assert "save kind='sharded'" in message
    assert os.listdir(tmp_path) == []
