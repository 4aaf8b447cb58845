"""Check a built sdist and wheel of fsdp-guide: metadata, contents, and that the wheel runs.

``twine check`` would add keyring, cryptography and a dozen other packages to the toolchain
to validate the same metadata that ``packaging`` (already pinned) validates. CI runs::

    python -m build --outdir dist . && python tests/helpers/dist_check.py dist

and the tests call :func:`check_dist` on a wheel they build.
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.metadata import Metadata

REPO = Path(__file__).resolve().parents[2]
NAME = "fsdp_guide"


def _metadata(raw: str) -> Metadata:
    # validate=True raises ExceptionGroup listing every invalid field.
    return Metadata.from_email(raw, validate=True)


def problems_of(metadata: Metadata, where: str) -> list[str]:
    """What a package index or a user would trip on in ``metadata``."""
    found = []
    urls = metadata.project_urls or {}
    for label in ("Documentation", "Repository"):
        if label not in urls:
            found.append(f"{where}: no Project-URL {label!r}")
    if metadata.description_content_type != "text/markdown":
        found.append(f"{where}: README content type {metadata.description_content_type!r}")
    if not (metadata.description or "").lstrip().startswith("# fsdp-guide"):
        found.append(f"{where}: the long description is not the README")
    if not metadata.requires_python:
        found.append(f"{where}: no Requires-Python")
    return found


def check_dist(dist: Path) -> list[str]:
    """Problems with the one wheel and one sdist in ``dist`` (empty when both are good)."""
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        return [f"expected one wheel and one sdist in {dist}, found {wheels + sdists}"]
    found: list[str] = []
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = set(wheel.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        found += problems_of(_metadata(wheel.read(info).decode()), wheels[0].name)
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        if "fsdp-guide = fsdp_guide.cli:main" not in wheel.read(entry_points).decode():
            found.append(f"{wheels[0].name}: no fsdp-guide command")
    # Everything the command line imports is a module of the package: all of them must ship.
    wanted = {
        str(p.relative_to(REPO)) for p in (REPO / NAME).rglob("*") if p.suffix in {".py", ".typed"}
    }
    found += [f"{wheels[0].name}: {m} missing" for m in sorted(wanted - names)]
    with tarfile.open(sdists[0]) as sdist:
        member = next(
            m for m in sdist.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")
        )
        raw = sdist.extractfile(member).read().decode()  # type: ignore[union-attr]
    found += problems_of(_metadata(raw), sdists[0].name)
    if Parser().parsestr(raw)["Name"] != "fsdp-guide":
        found.append(f"{sdists[0].name}: not named fsdp-guide")
    return found


def main() -> int:
    found = check_dist(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "dist")
    for problem in found:
        print(problem, file=sys.stderr)
    print("dist: metadata valid, wheel complete" if not found else f"{len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
