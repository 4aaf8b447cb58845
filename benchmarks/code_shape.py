"""The shape of the code, before and after the engine adapters, measured from the sources.

Run from the repository root:

    python benchmarks/code_shape.py [--before REV]

It reads the package's sources at ``REV`` (default: the commit before ``fsdp_guide/engines/``
existed) and in the working tree, and prints, for both, the figures that say how scattered an
engine is and how the package is entered, then writes ``benchmarks/results/code_shape.md``:

* **engine-name literals**: string constants (docstrings aside) that equal an engine or
  strategy name, outside ``catalog/`` and outside ``catalog/`` + ``engines/``; and the
  comparisons (``==``, ``in``) against them, the branches on names;
* **files touched by adding an engine**: package files changed by the commits that added
  DeepSpeed (before) and ``fsdp2_hybrid`` (after), from ``git show``;
* **cross-package private imports**: ``fsdp_guide.X._y`` imported from outside ``X``;
* **sub-package import cycles**: pairs of sub-packages that import each other;
* **public names per façade** (``__all__`` sizes) and names in more than one ``__all__``;
* **lines of hand-built tooling**: ``docs/_ext/*.py`` and the GPU runner
  (``benchmarks/gpu/``, ``benchmarks/gpu_validation.py``).

Everything is read with :mod:`ast` from the text of the files, nothing is imported, so an
old revision is measured the same way as the working tree.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "code_shape.md"
#: The last commit before the engine adapters: what the issue measured.
BEFORE = "6670fdd"
#: The commits that added DeepSpeed as an engine (catalog rows, setup, measuring,
#: predicting, communication, checkpoints, planner); its own sub-package's files count too.
DEEPSPEED_COMMITS = ("6fc1db5", "093b9f2", "fc23d09", "ac13881", "b23f3f2", "b848557", "2cd7206")
#: The commit that added ``fsdp2_hybrid`` through the adapters (set when it landed).
HYBRID_COMMITS: tuple[str, ...] = ("5b544ba",)

ENGINES = ("ddp", "zero", "zero1", "oss", "sharded_ddp", "fsdp1", "fsdp2", "fairscale_fsdp")
STRATEGIES = (
    "deepspeed",
    "sharded_ddp_buckets",
    "fsdp",
    "fsdp_grad_op",
    "fsdp_no_shard",
    "fsdp_hybrid",
    "fsdp2_hybrid",
    "deepspeed_zero1",
    "deepspeed_zero2",
    "deepspeed_zero2_offload",
    "deepspeed_zero3",
    "deepspeed_zero3_offload",
)
#: Every engine and strategy name (and alias) of the catalog, then and now.
NAMES = frozenset(ENGINES + STRATEGIES)


@dataclass(frozen=True)
class Tree:
    """The text of the files of one revision (``None``: the working tree)."""

    rev: str | None

    def files(self, prefix: str, suffix: str = ".py") -> list[str]:
        if self.rev is None:
            base = ROOT / prefix
            paths = [base] if base.is_file() else sorted(base.rglob(f"*{suffix}"))
            return [str(p.relative_to(ROOT)) for p in paths if p.is_file()]
        out = _git("ls-tree", "-r", "--name-only", self.rev, "--", prefix)
        return [p for p in out.splitlines() if p.endswith(suffix)]

    def text(self, path: str) -> str:
        if self.rev is None:
            return (ROOT / path).read_text()
        return _git("show", f"{self.rev}:{path}")


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                ids.add(id(value))
    return ids


def _sub_package(path: str) -> str:
    """``catalog`` for ``fsdp_guide/catalog/_table.py``; ``""`` for a top-level module."""
    parts = Path(path).parts
    return parts[1] if len(parts) > 2 else ""


def _package_sources(tree: Tree) -> Iterator[tuple[str, ast.Module]]:
    for path in tree.files("fsdp_guide"):
        yield path, ast.parse(tree.text(path))


def name_literals(tree: Tree, outside: tuple[str, ...]) -> tuple[int, int]:
    """(engine-name literals, comparisons against them) in files outside ``outside``."""
    literals = branches = 0
    for path, module in _package_sources(tree):
        if _sub_package(path) in outside:
            continue
        docs = _docstring_nodes(module)
        for node in ast.walk(module):
            if isinstance(node, ast.Constant) and node.value in NAMES and id(node) not in docs:
                literals += 1
            if isinstance(node, ast.Compare):
                for right in node.comparators:
                    values = right.elts if isinstance(right, ast.Tuple | ast.Set) else [right]
                    if any(isinstance(v, ast.Constant) and v.value in NAMES for v in values):
                        branches += 1
    return literals, branches


def _imported_modules(path: str, module: ast.Module) -> Iterator[str]:
    """Every ``fsdp_guide`` module a file imports, lazily or not (``from X import _y`` too)."""
    for node in ast.walk(module):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("fsdp_guide"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_guide"):
            assert node.module is not None
            yield node.module
            for alias in node.names:  # ``from fsdp_guide.memory import _deepspeed``
                if alias.name.startswith("_") and not _is_private(node.module):
                    yield f"{node.module}.{alias.name}"


def _is_private(module_name: str) -> bool:
    return any(p.startswith("_") for p in module_name.split(".")[1:])


def private_imports(tree: Tree) -> list[str]:
    """``importer -> fsdp_guide.X._y`` for each private module reached from outside ``X``."""
    found = []
    for path, module in _package_sources(tree):
        mine = _sub_package(path)
        for target in _imported_modules(path, module):
            parts = target.split(".")
            owner = parts[1] if len(parts) > 2 else ""
            if _is_private(target) and owner != mine and not (owner == "" and mine == ""):
                found.append(f"{path} -> {target}")
    return found


def sub_package_edges(tree: Tree) -> set[tuple[str, str]]:
    """(importer, imported) sub-packages; top-level modules are their own nodes."""
    edges = set()
    for path, module in _package_sources(tree):
        mine = _sub_package(path) or Path(path).stem
        for target in _imported_modules(path, module):
            parts = target.split(".")
            theirs = parts[1] if len(parts) > 1 else ""
            if theirs and theirs != mine and not theirs.startswith("__"):
                edges.add((mine, theirs))
    return edges


def cycles(edges: set[tuple[str, str]]) -> list[str]:
    """Pairs of sub-packages that import each other, and longer cycles through them."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str) -> bool:
        seen, stack = set(), [start]
        while stack:
            node = stack.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                stack.extend(graph.get(node, ()))
        return False

    return sorted({" <-> ".join(sorted((a, b))) for a, b in edges if reaches(b, a)})


def _all_names(text: str) -> list[str] | None:
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    return None


def facades(tree: Tree) -> dict[str, list[str]]:
    """Module name -> its ``__all__``, for every module that declares one."""
    out = {}
    for path in tree.files("fsdp_guide"):
        names = _all_names(tree.text(path))
        if names is not None:
            dotted = path[:-3].replace("/", ".").removesuffix(".__init__")
            out[dotted] = names
    return out


def across_sub_packages(alls: dict[str, list[str]], *, top_level: bool) -> list[str]:
    """Names in the ``__all__`` of modules of two or more sub-packages (``errors.py`` is one).

    A package re-exporting its own public modules' names is one place; ``fsdp_guide`` itself
    re-exporting a handful for notebooks counts only when ``top_level``.
    """
    owners: dict[str, set[str]] = {}
    for module, names in alls.items():
        parts = module.split(".")
        if len(parts) == 1 and not top_level:
            continue
        group = parts[1] if len(parts) > 1 else "(top level)"
        for name in names:
            owners.setdefault(name, set()).add(group)
    return sorted(name for name, groups in owners.items() if len(groups) > 1)


def lines(tree: Tree, *prefixes: str) -> int:
    return sum(len(tree.text(p).splitlines()) for prefix in prefixes for p in tree.files(prefix))


def touched(commits: tuple[str, ...]) -> list[str]:
    """Package files (``fsdp_guide/``) changed by ``commits``, each once."""
    files: set[str] = set()
    for commit in commits:
        out = _git("show", "--name-only", "--format=", commit, "--", "fsdp_guide")
        files.update(line for line in out.splitlines() if line)
    return sorted(files)


def measure(tree: Tree, engine_commits: tuple[str, ...]) -> dict[str, str]:
    """The figures of one tree, as table cells."""
    outside_catalog = name_literals(tree, ("catalog",))
    outside_both = name_literals(tree, ("catalog", "engines"))
    alls = facades(tree)
    counts = Counter(name for names in alls.values() for name in names)
    several = sorted(name for name, n in counts.items() if n > 1)
    across = across_sub_packages(alls, top_level=False)
    top = sorted(alls.items(), key=lambda kv: -len(kv[1]))[:3]
    private = private_imports(tree)
    files = touched(engine_commits) if engine_commits else []
    return {
        "engine-name literals outside catalog/": str(outside_catalog[0]),
        "engine-name literals outside catalog/ and engines/": str(outside_both[0]),
        "comparisons against engine names outside catalog/ and engines/": str(outside_both[1]),
        "package files touched by adding an engine": str(len(files)) if files else "-",
        "cross-package private imports": str(len(private)),
        "sub-package import cycles": ", ".join(cycles(sub_package_edges(tree))) or "none",
        "façades (modules with `__all__`)": str(len(alls)),
        "public names, all façades": str(sum(len(v) for v in alls.values())),
        "largest façades": ", ".join(f"{k.removeprefix('fsdp_guide.')} {len(v)}" for k, v in top),
        "names in more than one `__all__`": f"{len(several)}"
        + (f" ({', '.join(several)})" if several else ""),
        "names in the `__all__` of two sub-packages (the top level's aside)": f"{len(across)}"
        + (f" ({', '.join(across)})" if across else ""),
        "lines of the Sphinx extensions in docs/_ext": str(lines(tree, "docs/_ext")),
        "lines of the GPU runner": str(
            lines(tree, "benchmarks/gpu", "benchmarks/gpu_validation.py")
        ),
    }


def table(before: dict[str, str], after: dict[str, str]) -> str:
    rows = ["| figure | before | after |", "| --- | --- | --- |"]
    rows += [f"| {key} | {before[key]} | {after[key]} |" for key in before]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--before", default=BEFORE, help=f"revision to compare (default {BEFORE})")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    old, new = Tree(args.before), Tree(None)
    before, after = measure(old, DEEPSPEED_COMMITS), measure(new, HYBRID_COMMITS)
    text = table(before, after)
    print(text)
    # The lists name private modules: printed here, kept off the rendered results page.
    for title, items in (
        (
            f"files touched by adding DeepSpeed ({', '.join(DEEPSPEED_COMMITS)})",
            touched(DEEPSPEED_COMMITS),
        ),
        (
            f"files touched by adding fsdp2_hybrid ({', '.join(HYBRID_COMMITS)})",
            touched(HYBRID_COMMITS),
        ),
        (f"cross-package private imports at {args.before}", private_imports(old)),
        ("cross-package private imports now", private_imports(new)),
    ):
        print(f"\n{title}:" + "".join(f"\n  {item}" for item in items or ["none"]))
    report = [
        "# Code shape: one place per engine",
        "",
        f"Generated by `python benchmarks/code_shape.py`: *before* is commit `{args.before}`, "
        "*after* the working tree. Read from the sources with `ast`; nothing is imported. The "
        "command also prints the lists behind the counts (files touched, private imports).",
        "",
        text,
    ]
    args.out.write_text("\n".join(report).rstrip() + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
