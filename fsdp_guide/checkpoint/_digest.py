"""Integrity of a full checkpoint file: a SHA-256 of its contents, stored inside it (private).

``torch.save`` writes a zip archive (one member for the pickled structure, one per tensor
storage) and ``torch.load`` checks none of the CRC-32s it writes, so a file whose tensor
bytes changed (a bad disk, a bad copy) loads silently with other weights. A full checkpoint
therefore carries one more member, ``<archive>/fsdp_guide.sha256``: the SHA-256 of every
other member's name, size and bytes, computed by reading back the file as written. Before
anything of a full file is unpickled, :func:`verify` hashes those members again and refuses
the file, naming it, if the digests differ. It reads each member's bytes where the zip's
central directory (the index that ``torch.load`` follows too) says they are.

A full file written before this digest existed is checked against the zip's own CRC-32s
instead (which find changed bytes just as well, barring deliberate forgery) and loads with
a warning saying how to add the digest: save it again.
"""

from __future__ import annotations

import hashlib
import struct
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from fsdp_guide.errors import CheckpointError

DIGEST_MEMBER = "fsdp_guide.sha256"
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
_BLOCK = 1 << 20


def _members(zf: zipfile.ZipFile, handle: BinaryIO) -> Iterator[tuple[zipfile.ZipInfo, int]]:
    """Each member with the offset of its bytes, read from its local header."""
    for info in zf.infolist():
        handle.seek(info.header_offset)
        header = handle.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size:
            raise zipfile.BadZipFile(f"member {info.filename} lies past the end of the file")
        signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
        name = handle.read(name_length)
        if signature != b"PK\x03\x04" or name.decode("utf-8", "replace") != info.filename:
            raise zipfile.BadZipFile(f"the local header of {info.filename} does not match")
        if info.compress_type != zipfile.ZIP_STORED:  # torch.save stores, never compresses
            raise zipfile.BadZipFile(f"member {info.filename} is compressed")
        yield info, info.header_offset + _LOCAL_HEADER.size + name_length + extra_length


def _read(handle: BinaryIO, offset: int, size: int) -> Iterator[bytes]:
    handle.seek(offset)
    while size > 0:
        block = handle.read(min(size, _BLOCK))
        if not block:
            raise zipfile.BadZipFile("a member is cut short")
        size -= len(block)
        yield block


def _digest_and_crcs(path: Path) -> tuple[str, str | None, list[str]]:
    """The digest of the members, the stored one (or None), and members whose CRC-32 differs."""
    digest, stored, bad_crc = hashlib.sha256(), None, []
    with open(path, "rb") as handle, zipfile.ZipFile(handle) as zf:
        for info, offset in list(_members(zf, handle)):
            if info.filename.rsplit("/", 1)[-1] == DIGEST_MEMBER:
                stored = b"".join(_read(handle, offset, info.file_size)).decode("ascii", "replace")
                continue
            digest.update(info.filename.encode() + b"\0" + info.file_size.to_bytes(8, "little"))
            crc = 0
            for block in _read(handle, offset, info.file_size):
                digest.update(block)
                crc = zlib.crc32(block, crc)
            if info.CRC and crc != info.CRC:  # a CRC of 0: torch wrote none (crc32 option off)
                bad_crc.append(info.filename)
    return digest.hexdigest(), stored, bad_crc


def seal(path: Path) -> str:
    """Append the digest member to the torch file ``path``; return the digest.

    The bytes already written stay as they are: the member goes where the zip's central
    directory was, and a new directory follows it.

    Examples:
        >>> import tempfile, torch
        >>> path = Path(tempfile.mkdtemp()) / "a.pt"
        >>> torch.save({"w": torch.ones(2)}, path)
        >>> len(seal(path)), verify(path), torch.load(path)["w"]
        (64, True, tensor([1., 1.]))
    """
    digest, stored, _ = _digest_and_crcs(path)
    if stored is not None:
        raise ValueError(f"{path} already carries a digest")
    with zipfile.ZipFile(path, "a") as zf:
        prefix = zf.namelist()[0].split("/", 1)[0]  # torch reads members under one folder
        zf.writestr(f"{prefix}/{DIGEST_MEMBER}", digest.encode())
    return digest


def verify(path: Path) -> bool:
    """Check a full checkpoint file's bytes; return whether it carried a digest.

    Raises:
        CheckpointError: Naming the file, when its digest (or, in a file without one, a
            member's CRC-32) does not match its bytes, or its zip structure is broken.

    Examples:
        >>> import tempfile, torch
        >>> path = Path(tempfile.mkdtemp()) / "a.pt"
        >>> torch.save({"w": torch.ones(256)}, path)
        >>> _ = seal(path)
        >>> raw = bytearray(path.read_bytes())
        >>> raw[raw.index(torch.ones(1).numpy().tobytes()) + 1] ^= 1  # one bit of a weight
        >>> _ = path.write_bytes(bytes(raw))
        >>> verify(path)
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.CheckpointError: .../a.pt does not match the SHA-256 stored in it: ...
    """
    try:
        digest, stored, bad_crc = _digest_and_crcs(path)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is truncated or corrupt ({exc}); restore it or use an earlier checkpoint"
        ) from exc
    if stored is not None:
        if stored != digest:
            raise CheckpointError(
                f"{path} does not match the SHA-256 stored in it: its bytes changed after "
                "saving (a bad disk or copy); copy it again or use an earlier checkpoint"
            )
        return True
    if bad_crc:
        raise CheckpointError(
            f"{path} does not match the CRC-32 of {', '.join(bad_crc[:3])}: its bytes changed "
            "after saving (a bad disk or copy); copy it again or use an earlier checkpoint"
        )
    warnings.warn(
        f"{path} carries no SHA-256 of its contents (an earlier fsdp_guide or another program "
        "wrote it): its zip CRC-32s were checked instead. Save it again with "
        "fsdp_guide.checkpoint.save to add one",
        UserWarning,
        stacklevel=3,
    )
    return False
