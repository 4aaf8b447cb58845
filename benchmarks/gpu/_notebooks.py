"""The notebooks: which to run, running one with nbclient, and its CUDA outputs copied back.

Cells tagged ``skip-execution`` run too: the tag is stripped in the copy that runs and put
back in the executed copy. A CUDA cell's outputs are copied back into ``notebooks/`` only
when it is unchanged since the GPU run and CPU CI does not check them.
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ._checks import Checks
from ._paths import NOTEBOOKS

SKIP_TAG = "skip-execution"
NBVAL_CHECK_TAG = "nbval-check-output"
_CUDA_SOURCE = re.compile(
    r"torch\.cuda\.|\.cuda\(|nccl|accelerator=\"gpu\"|PLAN\.backend|PLAN\.accelerator"
)


def _source(cell: dict[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def _tags(cell: dict[str, Any]) -> list[str]:
    tags = cell.get("metadata", {}).get("tags", [])
    return list(tags) if isinstance(tags, list) else []


def _write(path: Path, notebook: dict[str, Any]) -> None:
    """Write ``notebook`` as Jupyter does (one-space indent, characters unescaped)."""
    path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def strip_tag(notebook: dict[str, Any], tag: str = SKIP_TAG) -> tuple[dict[str, Any], list[str]]:
    """A deep copy of ``notebook`` without ``tag`` on any cell, and the ids that had it.

    Examples:
        >>> nb = {"cells": [{"id": "a", "metadata": {"tags": ["skip-execution", "x"]}},
        ...                 {"id": "b", "metadata": {}}]}
        >>> copy_, ids = strip_tag(nb)
        >>> copy_["cells"][0]["metadata"]["tags"], ids, nb["cells"][0]["metadata"]["tags"]
        (['x'], ['a'], ['skip-execution', 'x'])
    """
    stripped = copy.deepcopy(notebook)
    ids = []
    for index, cell in enumerate(stripped.get("cells", [])):
        tags = _tags(cell)
        if tag in tags:
            ids.append(str(cell.get("id", index)))
            cell["metadata"]["tags"] = [t for t in tags if t != tag]
    return stripped, ids


def restore_tag(notebook: dict[str, Any], ids: Iterable[str], tag: str = SKIP_TAG) -> None:
    """Put ``tag`` back on the cells of ``ids`` (in place), as :func:`strip_tag` found them.

    Examples:
        >>> nb = {"cells": [{"id": "a", "metadata": {"tags": ["x"]}}]}
        >>> restore_tag(nb, ["a"])
        >>> nb["cells"][0]["metadata"]["tags"]
        ['skip-execution', 'x']
    """
    wanted = set(ids)
    for index, cell in enumerate(notebook.get("cells", [])):
        if str(cell.get("id", index)) in wanted and tag not in _tags(cell):
            cell.setdefault("metadata", {})["tags"] = [tag, *_tags(cell)]


def is_cuda_cell(cell: dict[str, Any]) -> bool:
    """Whether a code cell runs differently with a CUDA GPU (its outputs come from the GPU run).

    A code cell tagged ``skip-execution``, or whose source asks about CUDA, NCCL or the
    lesson's rank plan.

    Examples:
        >>> is_cuda_cell({"cell_type": "code", "source": "if torch.cuda.is_available():\\n  pass"})
        True
        >>> is_cuda_cell({"cell_type": "code", "source": "print(1)"})
        False
    """
    if cell.get("cell_type") != "code":
        return False
    return SKIP_TAG in _tags(cell) or bool(_CUDA_SOURCE.search(_source(cell)))


def copy_cuda_outputs(
    original: dict[str, Any], executed: dict[str, Any], note: str
) -> tuple[int, list[str]]:
    """Copy the outputs of the CUDA cells of ``executed`` into ``original`` (in place).

    Cells are matched by id and must have the same source (a cell edited since the GPU run
    keeps its outputs). Cells tagged ``nbval-check-output`` are left alone: CPU CI compares
    their outputs with what the CPU prints. Each copied cell records ``note`` (where its
    outputs come from) in its metadata, under ``fsdp_guide.outputs_from``.

    Args:
        original: The notebook in the repository.
        executed: Its copy executed on the GPU.
        note: Where the outputs come from, e.g. ``"one NVIDIA H100 80GB HBM3, torch 2.11.0"``.

    Returns:
        How many cells were copied, and a message for each cell that was not.
    """
    by_id = {cell.get("id"): cell for cell in executed.get("cells", [])}
    copied, messages = 0, []
    for cell in filter(is_cuda_cell, original.get("cells", [])):
        ran = by_id.get(cell.get("id"))
        where = f"cell {cell.get('id')}"
        if ran is None:
            messages.append(f"{where}: not in the executed copy")
        elif _source(ran) != _source(cell):
            messages.append(f"{where}: source changed since the GPU run; outputs not copied")
        elif NBVAL_CHECK_TAG in _tags(cell):
            messages.append(f"{where}: tagged {NBVAL_CHECK_TAG} (CPU CI checks it); left alone")
        else:
            cell["outputs"] = copy.deepcopy(ran.get("outputs", []))
            cell["execution_count"] = ran.get("execution_count")
            cell.setdefault("metadata", {}).setdefault("fsdp_guide", {})["outputs_from"] = note
            copied += 1
    return copied, messages


def copy_back(executed_dir: Path, note: str) -> int:
    """Copy the CUDA cells' outputs of the notebooks in ``executed_dir`` into ``notebooks/``."""
    for path in sorted(executed_dir.glob("*.ipynb")):
        target = NOTEBOOKS / path.name
        if not target.exists():
            print(f"{path.name}: no such notebook in {NOTEBOOKS}")
            continue
        original = json.loads(target.read_text(encoding="utf-8"))
        executed = json.loads(path.read_text(encoding="utf-8"))
        copied, messages = copy_cuda_outputs(original, executed, note)
        for message in messages:
            print(f"{path.name}: {message}")
        if copied:
            _write(target, original)
        print(f"{path.name}: outputs of {copied} CUDA cell(s) copied")
    print(f"Say in each lesson's text that these outputs come from {note}.")
    return 0


def notebook_paths(selection: Sequence[str] = ()) -> list[Path]:
    """The notebooks to run: all of ``notebooks/``, or those whose name starts with one given.

    Raises:
        ValueError: When a selection matches no notebook.
    """
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if not selection:
        return paths
    chosen: list[Path] = []
    for wanted in selection:
        name = Path(wanted).name
        matches = [p for p in paths if p.name.startswith(name)]
        if not matches:
            raise ValueError(f"no notebook in {NOTEBOOKS} starts with {name!r}")
        chosen += [p for p in matches if p not in chosen]
    return chosen


def run_notebook(path: Path, work_dir: Path, deadline: float) -> int:
    """Execute one notebook top to bottom with nbclient, ``skip-execution`` cells too.

    The executed copy, with the tag put back, is written to ``work_dir/executed/<name>``
    even when a cell failed. Every cell gets the time left until ``deadline`` seconds from
    now, so nbclient stops the kernel itself before the step's subprocess would be killed.

    Returns:
        0 when every cell ran, 1 otherwise.
    """
    import nbformat
    from nbclient import NotebookClient

    checks = Checks("notebook")
    end = time.monotonic() + deadline
    stripped, tagged = strip_tag(json.loads(path.read_text(encoding="utf-8")))
    # reads() (not from_dict) joins the cells' source lists, as reading the file would.
    notebook = nbformat.reads(json.dumps(stripped), as_version=4)  # type: ignore[no-untyped-call]
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        record_timing=False,  # no timestamps in the cells' metadata
        timeout_func=lambda cell: max(1, int(end - time.monotonic())),
        resources={"metadata": {"path": str(path.parent)}},
    )
    error = ""
    try:
        client.execute()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        print(error, flush=True)
    executed: dict[str, Any] = json.loads(nbformat.writes(notebook))  # type: ignore[no-untyped-call]
    restore_tag(executed, tagged)
    target = work_dir / "executed" / path.name
    target.parent.mkdir(parents=True, exist_ok=True)
    _write(target, executed)
    checks.record(
        path.stem, not error, f"executed copy {target}" + (f"; {error[:300]}" if error else "")
    )
    cuda = [str(c.get("id")) for c in executed["cells"] if is_cuda_cell(c)]
    checks.table(
        "Notebooks executed with nbclient",
        {
            "notebook": path.name,
            "code cells": sum(c["cell_type"] == "code" for c in executed["cells"]),
            "skip-execution cells run": len(tagged),
            "CUDA cells": ", ".join(cuda) or "none",
            "result": "ran" if not error else "error",
        },
    )
    return checks.finish()
