"""Checkpoints under faults, measured: what each fault costs (time to error, bytes left, exit).

Each scenario runs real processes against the installed ``fsdp_guide`` through its public
API and command line only, so the same script measures any version. Run from the
repository root (a private mount namespace for the full-disk rows: root, or ``unshare``
allowed for users)::

    python benchmarks/checkpoint_faults.py          # or only some items: ... 2 6

Scenarios: a flipped tensor byte in a full file; ``consolidate SRC SRC/index.json``; a disk
filled mid-save (full, and sharded on 2 ranks with the error left to propagate, as user
code would); a full save SIGKILLed mid-write, then saved again; malformed command lines;
an FSDP1 checkpoint saved at 2 ranks and loaded at 1 to 6.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from torch import nn

from fsdp_guide import checkpoint, launch

ROOT = Path(tempfile.mkdtemp(prefix="faults-"))
CLI = [sys.executable, "-m", "fsdp_guide"]


def run(argv: list[str], limit: float = 60, **kwargs: object) -> tuple[int | str, str, float]:
    """Exit status (or "hung"), stderr, seconds; the whole process group ends with it.

    The standard output is kept in ``run.stdout``.
    """
    started = time.monotonic()
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, **kwargs,  # type: ignore[call-overload]
    )  # fmt: skip
    try:
        run.stdout, err = process.communicate(timeout=limit)  # type: ignore[attr-defined]
        return process.returncode, err, time.monotonic() - started
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return "hung", "", time.monotonic() - started


def flipped_tensor_byte() -> str:
    path = ROOT / "flip.pt"
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    checkpoint.save(path, model)
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 99)
    with open(path, "rb") as handle:
        handle.seek(info.header_offset + 26)
        skip = sum(int.from_bytes(handle.read(2), "little") for _ in "ne")
    raw = bytearray(path.read_bytes())
    raw[info.header_offset + 30 + skip + 101] ^= 0x40
    path.write_bytes(bytes(raw))
    fresh = nn.Linear(64, 64)
    started = time.monotonic()
    try:
        checkpoint.load(path, fresh)
    except checkpoint.CheckpointError as exc:
        return f"CheckpointError after {time.monotonic() - started:.3f} s: {str(exc)[:60]}..."
    changed = int((fresh.weight != model.weight).sum() + (fresh.bias != model.bias).sum())
    return f"loaded silently, {changed} value(s) differ from the saved ones"


def save_sharded(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(nn.Linear(4, 3), mesh=init_device_mesh("cpu", (world_size,)))
    checkpoint.save(path, model, kind="sharded", extra={"step": 1})


def tree_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + file.read_bytes())
    return digest.hexdigest()


def consolidate_into_itself() -> str:
    source = ROOT / "src"
    launch(save_sharded, 1, args=(str(source),), start_method="fork")
    before = tree_digest(source)
    status, _, seconds = run([*CLI, "consolidate", str(source), str(source / "index.json")])
    intact = "SRC intact" if tree_digest(source) == before else "SRC CHANGED (index destroyed)"
    return f"exit {status} after {seconds:.1f} s, {intact}"


def full_disk() -> str:
    helper = Path(__file__).parents[1] / "tests" / "helpers" / "full_disk_run.py"
    as_user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    mount = ROOT / "small-disk"
    mount.mkdir()
    script = 'mount -t tmpfs -o size=3m tmpfs "$1" && exec "$2" "$3" "$1" 13 9'
    command = ["unshare", *as_user, "--mount", "--propagation", "private", "sh", "-c", script]
    status, err, _ = run([*command, "sh", str(mount), sys.executable, str(helper)], limit=600)
    if status != 0:
        return f"not measured (no private mount namespace here: {err.strip()[-80:]})"
    result = json.loads(run.stdout.strip().splitlines()[-1])  # type: ignore[attr-defined]
    full = result["full"]
    kept = [a for a in result["sharded"] if any(p.count("/") == 0 and p.startswith("data-")
            and p != a["named"] for p in a["left"])]  # fmt: skip
    torch_message = sum("unexpected pos" in a["error"] for a in result["sharded"])
    return (
        f"full: {full['error'][:70]}... after {full.get('seconds', 0):.2f} s, "
        f"{len(full['left'])} files left; sharded, 2 ranks: {len(kept)} of "
        f"{len(result['sharded'])} failed saves left their data-* directory, "
        f"{torch_message} said only 'unexpected pos'"
    )


KILLED_SAVE = """
import sys, torch
from torch import nn
from fsdp_guide import checkpoint
checkpoint.save(sys.argv[1], nn.Linear(4096, 8192, bias=False))
"""


def killed_mid_write() -> str:
    path = ROOT / "big.pt"
    for _ in range(5):
        process = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(path)])
        while process.poll() is None:
            temps = [p for p in ROOT.glob(".big.pt.tmp-*") if p.stat().st_size >= 1 << 20]
            if temps:
                process.kill()
                break
            time.sleep(0.001)
        process.wait()
        if not path.exists():
            break
        path.unlink()
    left = sum(p.stat().st_size for p in ROOT.glob(".big.pt.tmp-*"))
    checkpoint.save(path, nn.Linear(2, 2))
    after = sum(p.stat().st_size for p in ROOT.glob(".big.pt.tmp-*"))
    return f"{left:,} bytes of temporary file left by the kill; {after:,} after the next save"


def bad_command_lines() -> str:
    source = ROOT / "src6"  # item 3 may have destroyed "src"
    launch(save_sharded, 1, args=(str(source),), start_method="fork")
    index = json.loads((source / "index.json").read_text())
    lines = {}
    modules = ROOT / "modules"
    modules.mkdir()
    (modules / "user_import.py").write_text("raise ValueError('no config')\n")
    builders = (
        "import sys\ndef exits():\n    sys.exit(0)\ndef spins():\n    while True:\n        pass\n"
    )
    (modules / "user_build.py").write_text(builders)
    edits = {
        "index without strategy": {"strategy": None},
        "index without extra": {"extra": None},
        "index without metadata": {"metadata": None},
        "unknown layout": {"layout": "zip"},
        "files entry not a dict": {"files": {k: 5 for k in index["files"]}},
        "world_size 'two'": {"world_size": "two"},
        "extra outside the checkpoint": {"extra": "../outside.pt"},
    }
    for number, (name, edit) in enumerate(edits.items()):
        broken = ROOT / f"broken{number}"
        shutil.copytree(source, broken)
        changed = {k: v for k, v in {**index, **edit}.items() if v is not None}
        (broken / "index.json").write_text(json.dumps(changed))
        lines[name] = [*CLI, "consolidate", str(broken), str(ROOT / "out.pt")]
    (ROOT / "afile").write_text("x")
    lines["destination under a file"] = [*CLI, "consolidate", str(source), str(ROOT / "afile/o")]
    lines["module raising at import"] = [*CLI, "estimate", "--model", "user_import:build"]
    lines["builder calling sys.exit(0)"] = [*CLI, "estimate", "--model", "user_build:exits"]
    lines["builder never returning"] = [*CLI, "estimate", "--model", "user_build:spins"]
    usage = subprocess.run([*CLI, "estimate", "--help"], capture_output=True, text=True).stdout
    if "--build-timeout" in usage:  # versions without it wait for ever: stopped at 30 s here
        lines["builder never returning"] += ["--build-timeout", "10"]
    lines["--world-size of 401 digits"] = [*CLI, "estimate", "--params", "7B", "--world-size",
                                           "9" * 401]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(modules)}
    rows = []
    for name, argv in lines.items():
        status, err, seconds = run(argv, limit=30, env=env)
        said = [line for line in err.splitlines() if line.strip()]
        traceback = "traceback" if "Traceback" in err else f"{len(said)} line(s)"
        last = said[-1][:90] if said else ""
        rows.append(f"  {name}: exit {status}, {traceback}, {seconds:.1f} s: {last}")
    return "\n" + "\n".join(rows)


def load_at(rank: int, world_size: int, path: str) -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2)),
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )
    optimizer = torch.optim.AdamW(model.parameters())
    if not os.path.exists(path):  # the saving run
        model(torch.ones(3, 5)).sum().backward()
        optimizer.step()
        checkpoint.save(path, model, optimizer, kind="sharded")
        return "saved"
    try:
        checkpoint.load(path, model, optimizer)
    except checkpoint.CheckpointError as exc:
        return str(exc)[:80]
    return "ok"


def reshard_fsdp1() -> str:
    path = str(ROOT / "fsdp1")
    launch(load_at, 2, args=(path,), start_method="fork")
    rows = []
    for world in range(1, 7):
        started = time.monotonic()
        result = launch(load_at, world, args=(path,), start_method="fork")[0]
        rows.append(
            f"  saved at 2, loaded at {world}: {result} ({time.monotonic() - started:.1f} s)"
        )
    return "\n" + "\n".join(rows)


def main() -> None:
    torch.set_num_threads(1)
    chosen = sys.argv[1:]  # item numbers, all by default
    for item, scenario in [
        ("2 flipped tensor byte, full file", flipped_tensor_byte),
        ("3 consolidate SRC SRC/index.json", consolidate_into_itself),
        ("4 disk full mid-save (3 MiB tmpfs, 3.3 MiB model)", full_disk),
        ("5 full save SIGKILLed mid-write (128 MiB)", killed_mid_write),
        ("6 bad command lines", bad_command_lines),
        ("8 FSDP1 per-layer, odd sizes", reshard_fsdp1),
    ]:
        if not chosen or item.split()[0] in chosen:
            print(f"{item}: {scenario()}", flush=True)
    shutil.rmtree(ROOT, ignore_errors=True)


if __name__ == "__main__":
    main()
