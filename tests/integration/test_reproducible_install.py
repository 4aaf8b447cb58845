"""The install is reproducible: README, CI and Read the Docs use one pinned toolchain.

These tests read the repository's own files; they catch drift between the README's commands,
``.ci/run``, ``.readthedocs.yaml``, ``pyproject.toml`` and ``requirements/constraints.txt``.
"""

from __future__ import annotations

import re
import sys
import typing
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = "requirements/constraints.txt"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Tools a user of the library never needs: none may come with ``pip install -e .``.
DEV_ONLY = {
    "sphinx",
    "myst-nb",
    "sphinx-book-theme",
    "pytest",
    "nbval",
    "mypy",
    "ruff",
    "pip-tools",
    "jupyter",
    "ipykernel",
    "nbclient",
}


def readme_commands() -> list[str]:
    """The ``bash`` blocks of the README's quick start, in order (main job, then tests)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## Quick start")
    end = text.index("\n## ", start + 1)
    return re.findall(r"```bash\n(.*?)\n```", text[start:end], flags=re.S)


def ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]


def pins() -> dict[str, str]:
    """``name -> version`` of every line of the constraints file."""
    out: dict[str, str] = {}
    for raw in (ROOT / CONSTRAINTS).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;=<>!~]+)", line)
        assert match, f"{CONSTRAINTS}: not an exact pin: {raw!r}"
        out[canonicalize_name(match[1])] = match[2]
    return out


def declared_requirements() -> list[Requirement]:
    """Every requirement in pyproject.toml: core, every extra, the build backend."""
    project = PYPROJECT["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra]
    reqs += [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    return [r for r in reqs if canonicalize_name(r.name) != "fsdp-guide"]


def test_readme_has_two_commands_main_job_then_tests() -> None:
    main_job, tests = readme_commands()
    assert main_job.endswith("python -m fsdp_guide compare")
    assert tests.endswith("python -m pytest")


@pytest.mark.parametrize("which", [0, 1], ids=["main-job", "tests"])
def test_ci_runs_the_readme_command_exactly(which: int) -> None:
    command = readme_commands()[which]
    # ``|| exit $?``: set -e does not stop on a failure inside an && list.
    assert f"{command} || exit $?" in ci_lines(), f".ci/run does not run {command!r}"


def test_ci_runs_the_tests_last_in_a_fresh_venv() -> None:
    lines = [ln for ln in ci_lines() if ln and not ln.startswith(("#", "echo"))]
    venv = next(i for i, ln in enumerate(lines) if ln.startswith("python -m venv --clear"))
    first_pip = next(i for i, ln in enumerate(lines) if "pip install" in ln)
    assert venv < first_pip, "CI must install into its own fresh virtual environment"
    assert lines[-1] == f"{readme_commands()[1]} || exit $?"


@pytest.mark.parametrize("path", ["README.md", ".ci/run", ".readthedocs.yaml"])
def test_every_install_goes_through_the_constraints_file(path: str) -> None:
    text = (ROOT / path).read_text()
    if path == "README.md":
        text = "\n".join(readme_commands())
    installs = [ln for ln in text.splitlines() if re.search(r"pip install(?! --help)", ln)]
    assert installs, f"{path} installs nothing?"
    for line in installs:
        assert f"-c {CONSTRAINTS}" in line, f"{path}: unpinned install: {line.strip()}"


def test_constraints_pin_every_declared_requirement_within_its_range() -> None:
    pinned = pins()
    for req in declared_requirements():
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req} is not in {CONSTRAINTS}: run python -m piptools compile"
        version = Version(pinned[name])
        assert req.specifier.contains(version, prereleases=True), (
            f"{CONSTRAINTS} pins {name}=={version}, outside pyproject's {req}: regenerate it"
        )


def test_torch_is_the_pinned_cpu_build_without_cuda_packages() -> None:
    pinned = pins()
    assert pinned["torch"] == "2.13.0+cpu"
    cuda = sorted(n for n in pinned if n.startswith(("nvidia-", "triton")))
    assert not cuda, f"CUDA packages in the lock: {cuda}"


def test_build_backend_is_pinned_to_the_locked_version() -> None:
    (backend,) = PYPROJECT["build-system"]["requires"]
    req = Requirement(backend)
    assert str(req.specifier).startswith("=="), "the build backend must be an exact pin"
    assert pins()[canonicalize_name(req.name)] == str(req.specifier)[2:]


def test_read_the_docs_uses_the_python_the_lock_was_made_with() -> None:
    header = (ROOT / CONSTRAINTS).read_text()
    made_with = re.search(r"with Python (\d+\.\d+)", header)
    assert made_with
    rtd = (ROOT / ".readthedocs.yaml").read_text()
    assert re.search(rf'python: "{re.escape(made_with[1])}"', rtd)


def test_the_lock_matches_what_is_installed_here() -> None:
    """The environment running the tests is the locked one (CI installs through the lock)."""
    pinned = pins()
    for name in ("torch", "sphinx", "mypy", "ruff", "ipython", "pytorch-lightning"):
        installed = metadata.version(name)
        assert installed == pinned[name], f"{name} {installed} installed, {pinned[name]} locked"


def _closure(names: set[str]) -> set[str]:
    """Installed distributions reachable from ``names`` through their (non-extra) requirements."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for spec in requires:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            todo.append(req.name)
    return seen


def test_core_install_pulls_no_docs_or_test_tooling() -> None:
    core = {Requirement(r).name for r in PYPROJECT["project"]["dependencies"]}
    pulled = _closure(core)
    assert "torch" in pulled and "pytorch-lightning" in pulled
    assert not pulled & DEV_ONLY, f"pip install -e . would pull {sorted(pulled & DEV_ONLY)}"


def test_magic_constructor_annotations_resolve_at_run_time() -> None:
    """The API docs resolve the constructor's annotations; IPython's own name one it hides."""
    from fsdp_guide.launcher.magic import DistributedMagics

    hints = typing.get_type_hints(DistributedMagics.__init__)
    from IPython.core.interactiveshell import InteractiveShell

    assert hints["shell"] == InteractiveShell | None
