"""Draw every lesson figure into ``notebooks/figures/`` (the SVG files are committed).

Each ``lesson_NN.py`` beside this file has ``FIGURES``: file name to a function that returns a
matplotlib figure. Run from anywhere::

    python docs/_scripts/figures/make_figures.py          # write every figure
    python docs/_scripts/figures/make_figures.py --check  # exit 1 if a committed file differs
    python docs/_scripts/figures/make_figures.py --list   # the files it draws
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parents[2] / "notebooks" / "figures"
sys.path.insert(0, str(HERE))

from style import to_svg  # noqa: E402


def figures() -> Iterator[tuple[str, Callable[[], object]]]:
    """(file name, drawing function) of every figure, lesson by lesson."""
    for path in sorted(HERE.glob("lesson_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield from module.FIGURES.items()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    parser.add_argument("--list", action="store_true", help="print the file names")
    args = parser.parse_args(argv)
    stale = []
    for name, draw in figures():
        if args.list:
            print(name)
            continue
        svg = to_svg(draw())  # type: ignore[arg-type]
        target = OUT / name
        if args.check:
            if not target.is_file() or target.read_text() != svg:
                stale.append(name)
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            target.write_text(svg)
            print(f"wrote {target}")
    for name in stale:
        print(f"{name} differs from what its code draws: run make_figures.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
