"""Every lesson has the shape a learner can rely on (``docs/lessons.md``).

What you will learn → the idea, drawn (a figure made by code in the repository) → run it →
measured next to predicted → what to remember → exercises → API used. The checks read the
committed notebooks as a reader meets them: headings, figures, the length of what is visible,
every measured-looking number of the prose against the outputs beside it, the terms linked to
the glossary at first use, the names of the API where they really live, and no lab log.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
LESSONS = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))

#: The H2 headings every lesson has, in this order (a heading matches by its start, so
#: ``## Run it: OSS against DDP`` is a "Run it"). Other H2 sections may sit between "The idea"
#: and "What to remember".
SHAPE = (
    "What you will learn",
    "The idea",
    "Run it",
    "Measured next to predicted",
    "What to remember",
    "Exercises",
    "API used",
)
MAX_WORDS = 250
MAX_CODE_LINES = 50
MIN_ALT_WORDS = 8

#: Terms linked to the glossary at their first use in a lesson's prose.
TERMS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "model state",
    "flat parameter",
    "DTensor",
    "device mesh",
    "activation checkpointing",
    "mixed precision",
    "CPU offload",
)

LAB_LOG = {
    "the lesson's run time": r"\bran in \d|\bin \d+(?:\.\d+)? ?s on \d+ (?:CPU )?cores",
    "the machine's load": r"\bother jobs\b|\bmachine'?s load\b|\bshared cores\b",
    "the tests": r"\b(?:checked|measured|run|covered) by the tests\b|\btests of this package\b"
    r"|\bthe tests? (?:of|in) this (?:package|repository)\b|\bCI\b",
    "an earlier run": r"\bthe run before\b|\b(?:earlier|previous|last) runs?\b|\bfrom two runs\b"
    r"|\bthis run'?s figures\b",
}
WARNING_IN_OUTPUT = re.compile(r"\bWarning\b|\bwarn\(|^\[[WEI]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)


def _cells(notebook: str) -> list[dict[str, Any]]:
    return list(json.loads((NOTEBOOKS / notebook).read_text())["cells"])


def _source(cell: dict[str, Any]) -> str:
    text = cell["source"]
    return "".join(text) if isinstance(text, list) else str(text)


def _outputs_text(cell: dict[str, Any]) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if "text" in output:
            parts.append("".join(output["text"]))
        for kind, value in output.get("data", {}).items():
            if kind.startswith("text/"):
                parts.append("".join(value) if isinstance(value, list) else str(value))
    return "\n".join(parts)


def _visible(markdown: str) -> str:
    """The markdown a reader sees before unfolding anything: ``<details>`` blocks removed."""
    return re.sub(r"<details>.*?</details>", "", markdown, flags=re.DOTALL)


def _prose(markdown: str) -> str:
    """Markdown without code (fenced or inline), math and link targets."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.DOTALL)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\$[^$]*\$", " ", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def headings(cells: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(cell index, text) of every H2 heading of the markdown cells."""
    found = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        for line in _visible(_source(cell)).splitlines():
            if line.startswith("## "):
                found.append((index, line[3:].strip()))
    return found


def shape_problems(cells: list[dict[str, Any]]) -> list[str]:
    """What keeps the H2 headings from following :data:`SHAPE`."""
    seen = [text for _, text in headings(cells)]
    kinds = [next((k for k in SHAPE if text.startswith(k)), None) for text in seen]
    problems = []
    for kind in SHAPE:
        if kind not in kinds:
            problems.append(f"no '## {kind}' heading")
    firsts = [kinds.index(k) for k in SHAPE if k in kinds]
    if firsts != sorted(firsts):
        problems.append(f"the headings are not in the order {SHAPE}: {seen}")
    if kinds.count("Measured next to predicted") > 1:
        problems.append("more than one '## Measured next to predicted' section")
    if "What to remember" in kinds:
        after = [k for k in kinds[kinds.index("What to remember") + 1 :]]
        if any(k not in ("Exercises", "API used") for k in after):
            problems.append("only Exercises and API used follow 'What to remember'")
    return problems


def section(cells: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The cells from the first heading starting with ``kind`` to the next H2 heading."""
    marks = headings(cells)
    for position, (index, text) in enumerate(marks):
        if text.startswith(kind):
            end = marks[position + 1][0] if position + 1 < len(marks) else len(cells)
            # A heading's own cell belongs to it; the next heading's cell does not.
            return cells[index : max(end, index + 1)]
    return []


IMAGE = re.compile(r"!\[(?P<alt>[^\]]*)\]\((?P<path>[^)\s]+)\)")


def first_figure(cells: list[dict[str, Any]]) -> tuple[int, str, str] | None:
    """(cell index, alt text, path) of the first markdown image of the lesson."""
    for index, cell in enumerate(cells):
        if cell["cell_type"] == "markdown":
            match = IMAGE.search(_visible(_source(cell)))
            if match:
                return index, match["alt"], match["path"]
    return None


def figure_problems(cells: list[dict[str, Any]]) -> list[str]:
    """The concept figure: in "The idea", before any code cell but the setup cell, with alt
    text, and a file of notebooks/figures/."""
    found = first_figure(cells)
    if found is None:
        return ["no figure in the lesson's markdown"]
    index, alt, path = found
    problems = []
    idea = section(cells, "The idea")
    if not any(cell is cells[index] for cell in idea):
        problems.append(f"the first figure ({path}) is not in '## The idea'")
    code_before = [c for c in cells[:index] if c["cell_type"] == "code"]
    if len(code_before) > 1:
        problems.append(f"{len(code_before)} code cells run before the first figure (at most 1)")
    if len(alt.split()) < MIN_ALT_WORDS:
        problems.append(f"the figure's alt text is under {MIN_ALT_WORDS} words: {alt!r}")
    if not path.startswith("figures/") or not (NOTEBOOKS / path).is_file():
        problems.append(f"the figure {path!r} is not a file of notebooks/figures/")
    return problems


def long_cells(cells: list[dict[str, Any]]) -> list[str]:
    found = []
    for index, cell in enumerate(cells):
        text = _source(cell)
        if cell["cell_type"] == "markdown":
            words = len(_visible(text).split())
            if words > MAX_WORDS:
                found.append(f"markdown cell {index}: {words} visible words")
        elif cell["cell_type"] == "code":
            lines = len(text.splitlines())
            if lines > MAX_CODE_LINES:
                found.append(f"code cell {index}: {lines} lines")
    return found


#: A number that reads as a measurement: thousands separators, two decimals or more, or a
#: decimal with a unit or a ratio sign.
MEASURED = re.compile(
    r"(?<![\w.,])(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d{2,}|\d+\.\d+ ?(?:[kMGT]i?B|ms|s|x|×|%))"
    r"(?![\w.]\d)"
)
VERSION = re.compile(
    r"\b(?:torch|PyTorch|Python|CUDA|Lightning|DeepSpeed|transformers|FairScale|fairscale|NCCL|"
    r"v|version|release)\s+\d+(?:\.\d+)+",
)


def _bare(number: str) -> str:
    return re.sub(r" ?(?:[kMGT]i?B|ms|s|x|×|%)$", "", number)


def unsupported_numbers(cells: list[dict[str, Any]]) -> list[str]:
    """Measured-looking numbers of the prose that no output of the lesson shows."""
    shown = "\n".join(_outputs_text(c) for c in cells if c["cell_type"] == "code")
    missing = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        text = VERSION.sub(" ", _prose(_source(cell)))
        for match in MEASURED.finditer(text):
            bare = re.escape(_bare(match.group(0)))
            if not re.search(rf"(?<![\d,.]){bare}(?![\d])", shown):
                missing.append(f"markdown cell {index}: {match.group(0)!r}")
    return missing


def _glossary_link_spans(markdown: str) -> list[tuple[int, int]]:
    return [
        (m.start(), m.end())
        for m in re.finditer(r"\[[^\]]*\]\([^)]*glossary[^)]*\)", markdown, re.IGNORECASE)
    ]


def unlinked_terms(cells: list[dict[str, Any]]) -> list[str]:
    """Glossary terms whose first use in the lesson's prose is not a link to the glossary."""
    # A figure's alt text names what it draws, and cannot hold a link: it is not a use.
    prose = "\n\n".join(
        IMAGE.sub(" ", re.sub(r"```.*?```", " ", _source(c), flags=re.DOTALL))
        for c in cells
        if c["cell_type"] == "markdown"
    )
    problems = []
    for term in TERMS:
        pattern = re.compile(rf"(?<![\w-]){re.escape(term)}(?![\w-])", re.IGNORECASE)
        # Inline code is not prose: `all_gather` is an API name, not the term.
        for match in pattern.finditer(prose):
            before = prose[: match.start()]
            if before.count("`") % 2 == 1:
                continue
            if not any(a <= match.start() < b for a, b in _glossary_link_spans(prose)):
                problems.append(f"first use of {term!r} is not linked to the glossary")
            break
    return problems


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def misplaced_names(cells: list[dict[str, Any]]) -> list[str]:
    """API names the prose puts where they do not live."""
    problems = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        text = _source(cell)
        for dotted in set(re.findall(r"\bfsdp_guide(?:\.\w+)+", text)):
            if not _resolves(dotted):
                problems.append(f"markdown cell {index}: {dotted} does not exist")
        pairs = re.findall(
            r"`(\w+)(?:\([^`]*\))?`\s*\(?(?:from|in|of)\s+`(fsdp_guide(?:\.\w+)*)`", text
        )
        for name, module in pairs:
            if not _resolves(f"{module}.{name}"):
                problems.append(f"markdown cell {index}: {name} is not in {module}")
    return problems


def lab_log(cells: list[dict[str, Any]]) -> list[str]:
    found = []
    for index, cell in enumerate(cells):
        texts = [_source(cell)] if cell["cell_type"] == "markdown" else [_outputs_text(cell)]
        for text in texts:
            for what, pattern in LAB_LOG.items():
                for match in re.finditer(pattern, text):
                    found.append(f"cell {index}: {what}: {match.group(0)!r}")
        for output in cell.get("outputs", []):
            if output.get("name") == "stderr" and WARNING_IN_OUTPUT.search("".join(output["text"])):
                found.append(f"cell {index}: a library warning in the stored output")
    return found


def _fallback_prints(source: str) -> list[str]:
    """What a cell prints where CUDA is missing: the strings printed in the ``else`` of its
    ``if torch.cuda.is_available():``."""
    try:
        tree = ast.parse(
            "\n".join(line for line in source.splitlines() if not line.startswith("%"))
        )
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "cuda.is_available" in ast.unparse(node.test):
            for inner in (n for branch in node.orelse for n in ast.walk(branch)):
                if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                    found.append(inner.value.strip())
    return [text for text in found if text]


def gpu_output_cells(cells: list[dict[str, Any]]) -> list[int]:
    """Code cells whose stored output came from a run with CUDA: they branch on
    ``torch.cuda.is_available()`` and printed something else than their CPU fallback."""
    found = []
    for index, cell in enumerate(cells):
        source = _source(cell)
        if cell["cell_type"] != "code" or "cuda.is_available()" not in source:
            continue
        printed = _outputs_text(cell).strip()
        if printed and not any(text[:40] in printed for text in _fallback_prints(source)):
            found.append(index)
    return found


GPU_LABEL = re.compile(r"\bGPU\b.*\btorch \d+\.\d+|\btorch \d+\.\d+.*\bGPU\b", re.DOTALL)


def gpu_label_problems(cells: list[dict[str, Any]]) -> list[str]:
    """GPU outputs without a label above them (GPU, torch version), and prose that says such
    cells did not run."""
    problems = []
    gpu = gpu_output_cells(cells)
    for index in gpu:
        above = next((c for c in reversed(cells[:index]) if c["cell_type"] == "markdown"), None)
        if above is None or not GPU_LABEL.search(_visible(_source(above))):
            problems.append(f"cell {index}: a GPU run's output with no label (GPU, torch version)")
    if gpu:
        for index, cell in enumerate(cells):
            if cell["cell_type"] == "markdown" and re.search(r"\bdid not run\b", _source(cell)):
                problems.append(f"cell {index}: says a cell did not run above a GPU run's output")
    return problems


def remember_bullets(cells: list[dict[str, Any]]) -> int:
    text = "\n".join(_visible(_source(c)) for c in section(cells, "What to remember"))
    return sum(1 for line in text.splitlines() if re.match(r"[-*] ", line))


@pytest.mark.parametrize("notebook", LESSONS)
def test_the_headings_follow_the_lesson_shape(notebook: str) -> None:
    assert shape_problems(_cells(notebook)) == []


@pytest.mark.parametrize("notebook", LESSONS)
def test_a_concept_figure_comes_before_the_first_measurement(notebook: str) -> None:
    assert figure_problems(_cells(notebook)) == []


@pytest.mark.parametrize("notebook", LESSONS)
def test_visible_cells_are_short(notebook: str) -> None:
    assert long_cells(_cells(notebook)) == []


@pytest.mark.parametrize("notebook", LESSONS)
def test_what_to_remember_is_three_to_five_bullets(notebook: str) -> None:
    assert 3 <= remember_bullets(_cells(notebook)) <= 5


@pytest.mark.parametrize("notebook", LESSONS)
def test_every_measured_number_in_the_prose_is_in_an_output(notebook: str) -> None:
    assert unsupported_numbers(_cells(notebook)) == []


@pytest.mark.parametrize("notebook", LESSONS)
def test_terms_link_the_glossary_at_first_use(notebook: str) -> None:
    assert unlinked_terms(_cells(notebook)) == []


@pytest.mark.parametrize("notebook", LESSONS)
def test_api_names_are_where_the_prose_says(notebook: str) -> None:
    assert misplaced_names(_cells(notebook)) == []


@pytest.mark.parametrize("notebook", LESSONS)
def test_no_lab_log(notebook: str) -> None:
    assert lab_log(_cells(notebook)) == []


@pytest.mark.parametrize("notebook", LESSONS)
def test_gpu_outputs_are_labelled(notebook: str) -> None:
    assert gpu_label_problems(_cells(notebook)) == []


def test_the_glossary_defines_every_linked_term() -> None:
    glossary = (REPO / "docs" / "guide" / "glossary.md").read_text()
    entries = {line.strip().lower() for line in glossary.splitlines() if re.match(r"\S", line)}
    assert [t for t in TERMS if t.lower() not in entries] == []


# The checks themselves, on what the reader review found.
@pytest.mark.parametrize(
    ("prose", "outputs", "flagged"),
    [
        ("quotes 150,016 with sequence parallelism", "149,504 and 2,560", True),
        ("the table shows 17.26 MB", "DDP 17.26 MB per rank", False),
        ("a ratio of 1.25x", "ratio 1.250", True),
        ("In torch 2.13 and Python 3.10", "", False),
        ("see [ZeRO](https://arxiv.org/abs/1910.02054)", "", False),
        ("16 bytes per parameter", "", False),
    ],
)
def test_the_number_check_finds_what_readers_tripped_on(
    prose: str, outputs: str, flagged: bool
) -> None:
    cells = [
        {"cell_type": "markdown", "source": prose, "metadata": {}},
        {"cell_type": "code", "source": "", "metadata": {}, "outputs": [{"text": outputs}]},
    ]
    assert bool(unsupported_numbers(cells)) is flagged


@pytest.mark.parametrize(
    ("prose", "problems"),
    [
        ("Each rank runs a [reduce-scatter](../docs/guide/glossary.md#term-reduce-scatter).", 0),
        ("Each rank runs a reduce-scatter, then a [reduce-scatter](glossary.md).", 1),
        ("`reduce_scatter_tensor` is an API name, not prose.", 0),
        (
            "![Four ranks: an all-reduce and a reduce-scatter](figures/x.svg) Then a "
            "[reduce-scatter](../docs/guide/glossary.md#term-reduce-scatter) and an all-reduce.",
            1,
        ),
        ("![Each rank's reduce-scatter, drawn](figures/x.svg) A [reduce-scatter](glossary.md).", 0),
        ("![A figure](figures/x.svg) then a reduce-scatter, unlinked.", 1),
    ],
)
def test_the_glossary_check(prose: str, problems: int) -> None:
    cells = [{"cell_type": "markdown", "source": prose, "metadata": {}}]
    assert len(unlinked_terms(cells)) == problems


@pytest.mark.parametrize(
    ("prose", "flagged"),
    [
        ("`count_collectives` from `fsdp_guide.memory` counts", True),
        ("`count_collectives` from `fsdp_guide.comm` counts", False),
        ("`count_collectives` (from `fsdp_guide.memory`) counts", True),
        ("`fsdp_guide.memory.count_collectives`", True),
        ("`fsdp_guide.comm.count_collectives`", False),
    ],
)
def test_the_name_check(prose: str, flagged: bool) -> None:
    cells = [{"cell_type": "markdown", "source": prose, "metadata": {}}]
    assert bool(misplaced_names(cells)) is flagged


@pytest.mark.parametrize(
    "text",
    [
        "The lesson ran in 61 s on 2 CPU cores shared with other jobs.",
        "the cell checked by the tests",
        "which is why the tests of this package measure each setting three times",
        "the run before measured 11,589,148 for both",
    ],
)
def test_the_lab_log_check(text: str) -> None:
    assert lab_log([{"cell_type": "markdown", "source": text, "metadata": {}}])


GPU_CELL = (
    "if torch.cuda.is_available():\n    print(run_on_gpu())\n"
    "else:\n    print('no CUDA here: this cell needs a GPU')"
)


@pytest.mark.parametrize(
    ("label", "printed", "flagged"),
    [
        # What readers found in lessons 04, 05 and 09: "did not run" above an H100's output.
        ("The outputs come from a CPU-only machine, where it did not run.", "(root): 69,888", 2),
        ("Its output is from an NVIDIA H100 (torch 2.11.0, CUDA 13.0).", "(root): 69,888", 1),
        ("**GPU output:** one NVIDIA H100 80GB HBM3 (torch 2.11.0 with CUDA 13.0).",
         "(root): 69,888", 0),
        ("It needs CUDA.", "no CUDA here: this cell needs a GPU", 0),  # a CPU run's fallback
    ],
)  # fmt: skip
def test_the_gpu_label_check(label: str, printed: str, flagged: int) -> None:
    cells = [
        {"cell_type": "markdown", "source": label, "metadata": {}},
        {"cell_type": "code", "source": GPU_CELL, "metadata": {}, "outputs": [{"text": printed}]},
    ]
    assert len(gpu_label_problems(cells)) == flagged
