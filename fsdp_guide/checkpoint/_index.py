"""``index.json`` of a sharded checkpoint: read, checked field by field, files verified (private).

The index is the one file a load or ``consolidate`` trusts to say what else to open, so
every field is checked before anything uses it: a missing or mistyped field, an unknown
layout or strategy, or a path that is not a file of the checkpoint's ``data-<id>``
directory is a :class:`~fsdp_guide.errors.CheckpointError` naming the index and the field,
never a ``KeyError`` later on. ``extra``, ``metadata`` and ``shards`` must be files the
index lists, so they are size- and hash-checked like the rest and nothing outside the
checkpoint is ever opened.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fsdp_guide.checkpoint._io import (
    DATA_DIR,
    FORMAT_VERSION,
    INDEX_NAME,
    SHARDED_FORMAT,
    sha256_of,
)
from fsdp_guide.engines import ENGINES
from fsdp_guide.errors import CheckpointError


def _engines_by_layout() -> dict[str, tuple[str, ...]]:
    """The engines each sharded layout holds, as their adapters declare it."""
    held: dict[str, list[str]] = {}
    for engine in ENGINES:
        if engine.sharded_layout is not None:
            held.setdefault(engine.sharded_layout, []).append(engine.name)
    # Format 1 wrote PyTorch FSDP shards as rank files: refused later, saying how to convert.
    held["rank_files"] += held["dcp"]
    return {layout: tuple(sorted(held[layout])) for layout in sorted(held)}


_LAYOUTS = _engines_by_layout()
_SHA256 = re.compile(r"[0-9a-f]{64}")


def verify_sha256(directory: Path, index: dict[str, Any], names: Iterable[str]) -> None:
    """Compare the SHA-256 of each file in ``names`` with the one ``index`` records.

    Raises:
        CheckpointError: Naming the first file whose bytes changed after saving.

    Examples:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> _ = (root / "a").write_bytes(b"")
        >>> verify_sha256(root, {"files": {"a": {"sha256": "0" * 64}}}, ["a"])
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: a in ... does not match its SHA-256 in the index: ...
    """
    for name in names:
        if sha256_of(directory / name) != index["files"][name]["sha256"]:
            raise CheckpointError(
                f"{name} in {directory} does not match its SHA-256 in the index: it was "
                "changed after saving; copy it again or use an earlier checkpoint"
            )


class _Fields:
    """Checks of one index's fields, each raising with the index path and the field named."""

    def __init__(self, index_path: Path, index: dict[str, Any]) -> None:
        self.path, self.index = index_path, index

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"{self.path} {what}: the index is corrupt or was not written by fsdp_guide; "
            "use an earlier checkpoint"
        )

    def text(self, key: str, choices: Iterable[str] | None = None) -> str:
        value = self.index.get(key)
        allowed = list(choices) if choices is not None else None
        if not isinstance(value, str) or (allowed is not None and value not in allowed):
            expected = f"one of {', '.join(allowed)}" if allowed else "a string"
            raise self.fail(f"has {key} {value!r} ({expected} expected)")
        return value

    def count(self, key: str) -> int:
        value = self.index.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(f"has {key} {value!r} (a whole number >= 1 expected)")
        return value

    def file(self, key: str, name: Any, data: str) -> str:
        # Only "data-<id>/<file>" of this checkpoint's one data directory, and listed.
        if name is None:
            raise self.fail(f"has no {key}")
        parts = name.split("/") if isinstance(name, str) else []
        if (
            len(parts) != 2
            or not DATA_DIR.fullmatch(parts[0])
            or parts[1] in ("", ".", "..")
            or (data and parts[0] != data)
        ):
            raise self.fail(f"names {name!r} as {key}, which is not a file of its data directory")
        if key != "files" and name not in self.index["files"]:
            raise self.fail(f"names {name!r} as {key} but does not list it among its files")
        return str(name)


def check_index(index_path: Path, index: Any) -> dict[str, Any]:
    """Check every field of a parsed index; return it with ``layout`` filled in.

    Raises:
        CheckpointError: The first field that is missing, mistyped or points elsewhere.

    Examples:
        >>> check_index(Path("ckpt/index.json"), {"format": SHARDED_FORMAT, "version": 2})
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: ckpt/index.json has strategy None (one of ...
    """
    if not isinstance(index, dict) or index.get("format") != SHARDED_FORMAT:
        raise CheckpointError(f"{index_path} is not an fsdp_guide sharded checkpoint index")
    version = index.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{index_path} has format version {version!r}; this fsdp_guide reads versions up "
            f"to {FORMAT_VERSION}: upgrade fsdp_guide"
        )
    fields = _Fields(index_path, index)
    strategies = sorted({s for held in _LAYOUTS.values() for s in held})
    strategy = fields.text("strategy", strategies)
    index.setdefault("layout", "rank_files")  # format 1 wrote no layout: rank files
    layout = fields.text("layout", _LAYOUTS)
    if strategy not in _LAYOUTS[layout]:
        raise fields.fail(f"says {strategy!r} shards in layout {layout!r}, which never holds them")
    world = fields.count("world_size")
    if layout == "rank_files" and strategy in _LAYOUTS["dcp"]:
        return index  # format 1's PyTorch FSDP files: refused, with how to convert them
    files = index.get("files")
    if not isinstance(files, dict) or not files:
        raise fields.fail("lists no files")
    data = ""
    for name, info in files.items():
        data = fields.file("files", name, data).split("/")[0]
        size = info.get("size") if isinstance(info, dict) else None
        sha = info.get("sha256") if isinstance(info, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise fields.fail(f"gives {name} no size in bytes ({info!r})")
        if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
            raise fields.fail(f"gives {name} no SHA-256 ({info!r})")
    fields.file("extra", index.get("extra"), data)
    if layout == "dcp":
        fields.file("metadata", index.get("metadata"), data)
    if layout == "rank_files":
        shards = index.get("shards")
        if not isinstance(shards, list) or len(shards) != world:
            raise fields.fail(f"lists {shards!r} as shards, not one file per rank of {world}")
        for shard in shards:
            fields.file("shards", shard, data)
    optimizer = index.get("optimizer")
    if optimizer is not None and not (
        isinstance(optimizer, dict)
        and isinstance(optimizer.get("class"), str | None)
        and isinstance(optimizer.get("state_keys", []), list)
    ):
        raise fields.fail(f"describes its optimizer as {optimizer!r}")
    return index


def read_index(directory: Path, verify: bool = True) -> dict[str, Any]:
    """Read ``index.json`` of a sharded checkpoint, check its fields and every file it names.

    Args:
        directory: The checkpoint directory.
        verify: Also compare each file's SHA-256 (sizes are always compared); see
            :func:`verify_sha256` to hash some files only.

    Returns:
        The index: ``format``, ``version``, ``strategy``, ``world_size``, ``layout``,
        ``extra`` (and ``metadata`` or ``shards`` by layout), ``optimizer`` (its class and
        state keys, or ``None``) and ``files`` (relative path to ``{"size", "sha256"}``).

    Raises:
        CheckpointError: No index (an unfinished or foreign directory), an index of a newer
            format or with a bad field, a file missing, of the wrong size or hash.

    Examples:
        >>> import tempfile
        >>> read_index(Path(tempfile.mkdtemp()))
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: no index.json in ...: not a finished sharded ...
    """
    directory = Path(directory)
    index_path = directory / INDEX_NAME
    if not index_path.is_file():
        raise CheckpointError(
            f"no {INDEX_NAME} in {directory}: not a finished sharded checkpoint (a save that "
            "did not complete writes its index last); use an earlier checkpoint"
        )
    try:
        parsed = json.loads(index_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{index_path} is not valid JSON ({exc})") from exc
    index = check_index(index_path, parsed)
    files = index["files"]
    for name, info in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(
                f"missing checkpoint file {name} in {directory} (the index lists {len(files)} "
                "files); copy the whole directory, or use an earlier checkpoint"
            )
        size = path.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"{name} in {directory} is truncated or changed: {size} bytes, the index "
                f"says {info['size']}; copy it again or use an earlier checkpoint"
            )
    if verify:
        verify_sha256(directory, index, files)
    return index
