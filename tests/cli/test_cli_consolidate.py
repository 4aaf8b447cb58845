"""``python -m fsdp_guide consolidate SRC DST``: bad input is one line and exit 2, SRC untouched.

The index of a sharded checkpoint is the file that says what else to open: each malformed
variant below must be refused with one line on stderr, without writing DST, without
changing SRC, and without opening any file outside SRC (recorded with an audit hook).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_guide import checkpoint, launch
from fsdp_guide.cli import main

_opened: list[str] | None = None  # paths opened while a test records them


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], str | os.PathLike):
        _opened.append(os.path.realpath(args[0]))


sys.addaudithook(_audit)


def save_sharded(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(nn.Linear(4, 3), mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    checkpoint.save(path, model, optimizer, kind="sharded", extra={"step": 1})


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("consolidate") / "ckpt"
    launch(save_sharded, 1, args=(str(path),), backend="gloo", start_method="fork")
    return path


@pytest.fixture
def source(pristine: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(pristine, copy)
    return copy


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` with the SHA-256 of its bytes."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("fsdp_guide consolidate: error: ")
    return captured.err


def test_a_good_checkpoint_consolidates(source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["consolidate", str(source), str(source.parent / "full.pt")]) == 0
    assert "consolidated 1 fsdp2 shards" in capsys.readouterr().out
    assert checkpoint.load(source.parent / "full.pt", nn.Linear(4, 3)) == {"step": 1}


def test_the_reported_command_leaves_the_source_intact(source: Path) -> None:
    before = tree(source)
    command = [sys.executable, "-m", "fsdp_guide", "consolidate", str(source)]
    done = subprocess.run(
        [*command, str(source / "index.json")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"fsdp_guide consolidate: error: DST {source / 'index.json'} is inside the checkpoint "
        f"SRC {source}: writing it would change the checkpoint being read; write the full file "
        "elsewhere, e.g. beside SRC"
    ]
    assert tree(source) == before


def _data_file(source: Path) -> Path:
    return next(source.glob("data-*/__0_0.distcp"))


def _symlink_to_index(source: Path) -> Path:
    link = source.parent / "elsewhere.pt"
    link.symlink_to(source / "index.json")
    return link


def _hardlink_to_data(source: Path) -> Path:
    link = source.parent / "elsewhere.pt"
    os.link(_data_file(source), link)
    return link


def _through_symlinked_dir(source: Path) -> Path:
    (source.parent / "alias").symlink_to(source)
    return source.parent / "alias" / "full.pt"


DESTINATIONS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "its index": (lambda s: s / "index.json", "is inside the checkpoint SRC"),
    "a data file": (_data_file, "is inside the checkpoint SRC"),
    "a new file in it": (lambda s: s / "full.pt", "is inside the checkpoint SRC"),
    "a new file in its data directory": (
        lambda s: _data_file(s).parent / "full.pt",
        "is inside the checkpoint SRC",
    ),
    "SRC itself": (lambda s: s, "is a directory"),
    "a symbolic link to its index": (_symlink_to_index, "is inside the checkpoint SRC"),
    "a hard link to a data file": (_hardlink_to_data, "under another name (a link)"),
    "a path through a link to SRC": (_through_symlinked_dir, "is inside the checkpoint SRC"),
}


@pytest.mark.parametrize("case", list(DESTINATIONS))
def test_destination_that_would_change_the_source_is_refused(
    source: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    make, message = DESTINATIONS[case]
    target = make(source)
    before = tree(source)
    assert message in one_error_line(capsys, ["consolidate", str(source), str(target)])
    assert tree(source) == before


def test_destination_under_a_file(source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (source.parent / "afile").write_text("x")
    target = source.parent / "afile" / "sub" / "full.pt"
    err = one_error_line(capsys, ["consolidate", str(source), str(target)])
    assert f"lies under {source.parent / 'afile'}, which is a file" in err


def _edit(**changes: Any) -> Callable[[dict[str, Any], Path], None]:
    def edit(index: dict[str, Any], source: Path) -> None:
        for key, value in changes.items():
            if value is _DROP:
                index.pop(key)
            else:
                index[key] = value(index, source) if callable(value) else value

    return edit


_DROP = object()


def _first_file(index: dict[str, Any]) -> str:
    return next(iter(index["files"]))


def _outside(index: dict[str, Any], source: Path) -> str:
    return "../outside.pt"


def _unlisted(index: dict[str, Any], source: Path) -> str:
    data = _first_file(index).split("/")[0]
    (source / data / "stray.pt").write_bytes((source.parent / "outside.pt").read_bytes())
    return f"{data}/stray.pt"


def _files_entry(value: Any) -> Callable[[dict[str, Any], Path], None]:
    def edit(index: dict[str, Any], source: Path) -> None:
        index["files"][_first_file(index)] = value

    return edit


INDEXES: dict[str, tuple[Callable[[dict[str, Any], Path], None], str]] = {
    "no strategy": (_edit(strategy=_DROP), "has strategy None"),
    "an unknown strategy": (_edit(strategy="zero9"), "has strategy 'zero9'"),
    "no extra": (_edit(extra=_DROP), "has no extra"),
    "no metadata": (_edit(metadata=_DROP), "has no metadata"),
    "an unknown layout": (_edit(layout="zip"), "has layout 'zip'"),
    "a layout that never holds the strategy": (_edit(layout="deepspeed"), "never holds them"),
    "a files entry that is not a dict": (_files_entry(5), "no size in bytes (5)"),
    "a files entry without a hash": (_files_entry({"size": 1}), "no SHA-256"),
    "a files entry with a negative size": (
        _files_entry({"size": -1, "sha256": "0" * 64}),
        "no size in bytes",
    ),
    "files that are a list": (_edit(files=[]), "lists no files"),
    "no files": (_edit(files={}), "lists no files"),
    "world_size 'two'": (_edit(world_size="two"), "has world_size 'two'"),
    "world_size 0": (_edit(world_size=0), "has world_size 0"),
    "world_size true": (_edit(world_size=True), "has world_size True"),
    "world_size 2.5": (_edit(world_size=2.5), "has world_size 2.5"),
    "no version": (_edit(version=_DROP), "format version None"),
    "a newer version": (_edit(version=99), "format version 99"),
    "another format": (_edit(format="other"), "is not an fsdp_guide sharded checkpoint index"),
    "an optimizer that is a string": (_edit(optimizer="adam"), "describes its optimizer"),
    "extra outside the checkpoint": (_edit(extra=_outside), "not a file of its data directory"),
    "extra at an absolute path": (
        _edit(extra=lambda i, s: str(s.parent / "outside.pt")),
        "not a file of its data directory",
    ),
    "metadata outside the checkpoint": (
        _edit(metadata=_outside),
        "not a file of its data directory",
    ),
    "metadata of another data directory": (
        _edit(metadata="data-0123456789ab/.metadata"),
        "not a file of its data directory",
    ),
    "extra not among the files": (_edit(extra=_unlisted), "does not list it among its files"),
}


@pytest.mark.parametrize("case", list(INDEXES))
def test_malformed_index_is_one_line_and_opens_nothing_outside(
    source: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    global _opened
    outside = source.parent / "outside.pt"
    torch.save({"extra": {"secret": 1}}, outside)  # what a crafted index would point at
    edit, message = INDEXES[case]
    index = json.loads((source / "index.json").read_text())
    edit(index, source)
    (source / "index.json").write_text(json.dumps(index))
    target = source.parent / "full.pt"
    _opened = []
    try:
        err = one_error_line(capsys, ["consolidate", str(source), str(target)])
    finally:
        opened, _opened = _opened, None
    assert message in err
    assert not target.exists()
    assert os.path.realpath(outside) not in opened
    assert all(p.startswith(os.path.realpath(source)) for p in opened if p.endswith(".pt"))


@pytest.mark.parametrize("content", [b"[1, 2]", b'"index"', b"\xff\xfe", b"[" * 100_000, b"{", b""])
def test_index_that_is_not_an_index_object(
    source: Path, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    (source / "index.json").write_bytes(content)
    err = one_error_line(capsys, ["consolidate", str(source), str(source.parent / "full.pt")])
    assert "index.json" in err
