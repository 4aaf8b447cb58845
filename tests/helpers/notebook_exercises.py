"""Read a lesson's exercises and cut the notebook down to the cells they depend on.

An exercise is three cells (see the engineers' exercise format): a code cell tagged
``exercise`` (the stub: names set to ``None``), a code cell tagged ``exercise-check`` (prints
``Exercise N: not attempted yet`` / ``Exercise N: correct``, raises ``AssertionError`` for a
wrong answer), and a markdown cell ``<details><summary>Solution</summary>`` with one fenced
python block that replaces the stub.

The exercises run in the lesson's own kernel after nbval has run the lesson
(``lesson_checks.py``). When the lesson's cells were deselected (``pytest -k exercise``),
:func:`needed_cells` finds, by reading the code, the cells whose names the exercises use, so
that only those run first: for each name, the last cell before the use that defines it (and
earlier ones when that definition is conditional), the cells in between that change it in
place (``x.a = ...``, ``x[i] = ...``, ``x.append(...)``), and, in turn, what those cells use.
The lesson's first code cell (imports, the rank plan) and ``%load_ext`` lines always run. A
name defined only by a cell the slice leaves out fails the run loudly (a ``NameError``),
never silently.
"""

from __future__ import annotations

import ast
import functools
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any

EXERCISE, CHECK = "exercise", "exercise-check"
SOLUTION_RE = re.compile(
    r"\A\s*<details>\s*<summary>Solution</summary>\s*```python\n(?P<code>.*?)```\s*</details>\s*\Z",
    re.DOTALL,
)
NUMBER_RE = re.compile(r"Exercise (\d+):")


# Runs before the solutions: the checks' launches are seeded and deterministic, so a launch of
# the same function with the same arguments (a second check, or the pass with wrong answers)
# gets the first one's results back instead of starting the ranks again.
REPLAY_LAUNCHES = textwrap.dedent(
    """
    _launched = {}
    if "launch" in globals():
        _launch_ranks = launch

        def launch(fn, *args, **kwargs):
            key = (getattr(fn, "__qualname__", repr(fn)), repr(args), repr(kwargs))
            if key not in _launched:
                _launched[key] = _launch_ranks(fn, *args, **kwargs)
            return _launched[key]


    def _report_answers(number, names):
        # What a solution gave its names, when it is a number or a short string.
        import json

        shown = {}
        for name in names:
            value = globals().get(name)
            if isinstance(value, int | float | str) and not isinstance(value, bool):
                if not isinstance(value, str) or len(value) <= 40:
                    shown[name] = value
        print(f"ANSWERS {number} " + json.dumps(shown))
    """
)

# Replaces a reader's answer by a wrong one of the same shape (run in the kernel).
WRONG_ANSWER = textwrap.dedent(
    '''
    def _wrong_answer(value):
        """A value of the same kind as `value` that is not equal to it."""
        import torch

        if isinstance(value, bool):
            return not value
        if isinstance(value, int):
            return value + 1
        if isinstance(value, float):
            return value * 1.5 + 1.0
        if isinstance(value, str):
            return value + " (wrong)"
        if isinstance(value, torch.Tensor):
            return value + 1
        if isinstance(value, tuple | list):
            items = list(value) or ["wrong"]
            items[0] = _wrong_answer(items[0]) if value else items[0]
            return type(value)(items)
        if isinstance(value, dict):
            if not value:
                return {"wrong": 1}
            first = next(iter(value))
            return {**value, first: _wrong_answer(value[first])}
        if isinstance(value, set | frozenset):
            return type(value)(value | {"wrong"})
        if callable(value):
            def wrong(*args, **kwargs):
                return _wrong_answer(value(*args, **kwargs))
            return wrong
        raise TypeError(f"no wrong answer known for a {type(value).__name__}")
    '''
)


class ExerciseFormatError(AssertionError):
    """A lesson's exercises do not follow the stub / check / solution format."""


@dataclass(frozen=True)
class Exercise:
    number: int
    stub_index: int
    check_index: int
    stub: str
    check: str
    solution: str
    names: tuple[str, ...]  # what the stub sets to None (or defines to return None)


def tags(cell: dict[str, Any]) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def source(cell: dict[str, Any]) -> str:
    text = cell["source"]
    return "".join(text) if isinstance(text, list) else str(text)


def stub_names(stub: str) -> tuple[str, ...]:
    """Names a stub leaves for the reader: ``x = None`` and functions whose body returns None."""
    names: list[str] = []
    for node in ast.parse(stub).body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and _is_none(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.FunctionDef) and _returns_only_none(node):
            names.append(node.name)
    return tuple(names)


def _is_none(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Constant) and value.value is None


def _returns_only_none(function: ast.FunctionDef) -> bool:
    returns = [n for n in ast.walk(function) if isinstance(n, ast.Return)]
    return all(r.value is None or _is_none(r.value) for r in returns)


def exercises(cells: list[dict[str, Any]]) -> list[Exercise]:
    """The lesson's exercises, in order; raises ExerciseFormatError naming what is wrong."""
    found: list[Exercise] = []
    for i, cell in enumerate(cells):
        if EXERCISE not in tags(cell):
            continue
        where = f"cell {i}"
        if cell["cell_type"] != "code":
            raise ExerciseFormatError(f"{where}: an exercise stub must be a code cell")
        if i + 2 >= len(cells):
            raise ExerciseFormatError(f"{where}: a stub needs a check and a solution after it")
        check, solution = cells[i + 1], cells[i + 2]
        if check["cell_type"] != "code" or CHECK not in tags(check):
            raise ExerciseFormatError(f"{where}: the next cell must be tagged {CHECK!r}")
        if solution["cell_type"] != "markdown":
            raise ExerciseFormatError(f"{where}: the cell after the check must be the solution")
        match = SOLUTION_RE.match(source(solution))
        if match is None or source(solution).count("```") != 2:
            raise ExerciseFormatError(
                f"{where}: the solution must be <details><summary>Solution</summary>, exactly "
                "one ```python block, </details>"
            )
        numbers = set(NUMBER_RE.findall(source(check)))
        if len(numbers) != 1:
            raise ExerciseFormatError(f"{where}: the check must print 'Exercise N: ...' for one N")
        names = stub_names(source(cell))
        if not names:
            raise ExerciseFormatError(f"{where}: the stub sets no name to None")
        defined = _defines(ast.parse(match["code"]))
        if missing := [n for n in names if n not in defined]:
            raise ExerciseFormatError(f"{where}: the solution does not define {missing}")
        found.append(
            Exercise(
                number=int(numbers.pop()),
                stub_index=i,
                check_index=i + 1,
                stub=source(cell),
                check=source(check),
                solution=match["code"],
                names=names,
            )
        )
    if [e.number for e in found] != list(range(1, len(found) + 1)):
        raise ExerciseFormatError(f"exercises are numbered {[e.number for e in found]}")
    for tagged in (i for i, c in enumerate(cells) if CHECK in tags(c)):
        if tagged not in {e.check_index for e in found}:
            raise ExerciseFormatError(f"cell {tagged}: a check without a stub before it")
    return found


@functools.cache
def _transformer() -> Any:
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager()


def python_source(cell_source: str) -> str:
    """A code cell as plain Python: magics become ``get_ipython()`` calls."""
    return str(_transformer().transform_cell(cell_source))


@dataclass
class CellNames:
    defines: set[str] = field(default_factory=set)
    conditional: set[str] = field(default_factory=set)  # defined inside if/for/try/with
    modifies: set[str] = field(default_factory=set)
    uses: set[str] = field(default_factory=set)
    loads_extension: bool = False


def _defines(tree: ast.Module) -> set[str]:
    return analyse(tree).defines


def _stored_names(target: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _loads(node: ast.AST, local: set[str]) -> set[str]:
    """Free names a node reads; names bound inside functions and comprehensions are local."""
    found: set[str] = set()

    def visit(n: ast.AST, bound: set[str]) -> None:
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = n.args
            inner = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
            inner |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
            for d in [*args.defaults, *args.kw_defaults]:
                if d is not None:
                    visit(d, bound)
            body = n.body if isinstance(n.body, list) else [n.body]
            stored = {
                x.id
                for stmt in body
                for x in ast.walk(stmt)
                if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Store)
            }
            for stmt in body:
                visit(stmt, bound | inner | stored)
            return
        if isinstance(n, ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp):
            inner = set().union(*(_stored_names(g.target) for g in n.generators))
            for child in ast.iter_child_nodes(n):
                visit(child, bound | inner)
            return
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound:
            found.add(n.id)
        for child in ast.iter_child_nodes(n):
            visit(child, bound)

    visit(node, local)
    return found


def _blocks(node: ast.stmt) -> tuple[list[ast.expr], set[str], list[list[ast.stmt]]]:
    """A compound statement's header expressions, the names its header binds, its blocks."""
    if isinstance(node, ast.For | ast.AsyncFor):
        return [node.iter], _stored_names(node.target), [node.body, node.orelse]
    if isinstance(node, ast.With | ast.AsyncWith):
        bound = set().union(
            *(_stored_names(i.optional_vars) for i in node.items if i.optional_vars is not None)
        )
        return [i.context_expr for i in node.items], bound, [node.body]
    if isinstance(node, ast.If | ast.While):
        return [node.test], set(), [node.body, node.orelse]
    if isinstance(node, ast.Try):
        handlers = [h.body for h in node.handlers]
        bound = {h.name for h in node.handlers if h.name}
        return [], bound, [node.body, *handlers, node.orelse, node.finalbody]
    raise TypeError(type(node).__name__)


COMPOUND = (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.If, ast.While, ast.Try)


def analyse(tree: ast.Module) -> CellNames:
    """What a cell defines, changes in place and reads, at notebook scope.

    Statements are read in order: a name the cell bound before (even inside a branch) is
    the cell's own when read later, not a use of an earlier cell's.
    """
    names = CellNames()

    def calls_and_walrus(node: ast.AST, bound: set[str]) -> None:
        for n in ast.walk(node):
            if isinstance(n, ast.NamedExpr):
                bound.add(n.target.id)
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
                continue
            if (root := _root(n.func.value)) is not None:
                names.modifies.add(root)  # x.append(...), x.update(...): maybe in place
            first = n.args[0] if n.args else None
            if n.func.attr == "run_line_magic" and isinstance(first, ast.Constant):
                names.loads_extension |= first.value == "load_ext"

    def bind(bound: set[str], conditional: bool) -> None:
        names.defines |= bound
        if conditional:
            names.conditional |= bound

    def statement(node: ast.stmt, conditional: bool) -> None:
        bound: set[str] = set()
        if isinstance(node, COMPOUND):
            headers, bound, blocks = _blocks(node)
            for header in headers:
                names.uses |= _loads(header, names.defines)
                calls_and_walrus(header, bound)
            bind(bound, conditional=True)
            for block in blocks:
                for inner in block:
                    statement(inner, conditional=True)
            return
        names.uses |= _loads(node, names.defines)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store):
                        bound.add(t.id)
                root = _root(target) if isinstance(target, ast.Attribute | ast.Subscript) else None
                if root is not None:
                    names.modifies.add(root)
        elif isinstance(node, ast.Delete):
            names.modifies |= {r for t in node.targets if (r := _root(t)) is not None}
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            calls_and_walrus(node, bound)
        bind(bound, conditional)

    for node in tree.body:
        statement(node, conditional=False)
    # What a cell defines and never reads back is not a change to an earlier definition.
    names.modifies -= names.defines - names.uses
    return names


def needed_cells(cells: list[dict[str, Any]], uses: set[str], before: int) -> list[int]:
    """Indices of the code cells before ``before`` that code reading ``uses`` depends on."""
    code = [i for i, c in enumerate(cells[:before]) if c["cell_type"] == "code"]
    parsed = {i: analyse(ast.parse(python_source(source(cells[i])))) for i in code}
    imported = {
        name
        for i in code
        for node in ast.walk(ast.parse(python_source(source(cells[i]))))
        if isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.ClassDef)
        for name in (
            [(a.asname or a.name).split(".")[0] for a in node.names]
            if isinstance(node, ast.Import | ast.ImportFrom)
            else [node.name]
        )
    }
    keep: set[int] = {code[0]} if code else set()
    keep |= {i for i in code if parsed[i].loads_extension}
    todo = [(name, before) for name in uses]
    todo += [(name, i) for i in keep for name in parsed[i].uses]
    seen: set[tuple[str, int]] = set()
    while todo:
        name, at = todo.pop()
        if (name, at) in seen:
            continue
        seen.add((name, at))
        earlier = [i for i in code if i < at]
        definitions = []
        for i in reversed(earlier):
            if name in parsed[i].defines:
                definitions.append(i)
                if name not in parsed[i].conditional:
                    break
        if not definitions:
            continue  # a builtin, or something the kernel provides
        first = min(definitions)
        changes = (
            []
            if name in imported
            else [i for i in earlier if i > first and name in parsed[i].modifies]
        )
        for i in [*definitions, *changes]:
            if i not in keep:
                keep.add(i)
                todo += [(n, i) for n in parsed[i].uses]
    return sorted(keep)


def exercise_uses(exercise: Exercise) -> set[str]:
    """What the solution and the check read from the lesson."""
    uses: set[str] = set()
    for code in (exercise.solution, exercise.check):
        uses |= analyse(ast.parse(python_source(code))).uses
    return uses


# -- answers given away: the value a solution gives, already printed above its exercise ----

#: Words too common to tie an output line to an exercise's prompt.
COMMON_WORDS = frozenset(
    re.findall(
        r"\w+",
        "about above after again answer bytes check each every from have here many much once "
        "rank ranks that their them then there these this what when which with would your",
    )
)
MIN_SHARED_WORDS = 3


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z][a-z_-]{3,}", text.lower()) if w not in COMMON_WORDS}


def _forms(value: object) -> tuple[list[str], bool]:
    """The ways an output may print ``value``, and whether they are distinctive on their own.

    A number of four digits or more (or a decimal with three significant digits), or a string
    of eight characters or more that is not a plain word, is unlikely to be printed by chance;
    a smaller value is a give-away only on an output line that shares words with the
    exercise's prompt.

    Examples:
        >>> _forms(568352)
        (['568352', '568,352'], True)
        >>> _forms(3)
        (['3'], False)
    """
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        forms = list(dict.fromkeys([str(value), f"{value:,}"]))
        return forms, abs(value) >= 1000
    if isinstance(value, float):
        forms = list(dict.fromkeys([repr(value), *(f"{value:.{d}f}" for d in (2, 3, 4))]))
        forms = [f for f in forms if f.strip("-0.")]
        distinctive = len(re.sub(r"\D", "", f"{value:.3g}").lstrip("0")) >= 3
        return forms, distinctive
    text = str(value)
    return [text], len(text) >= 8 and not text.isalpha()  # "blocks.3", not a plain word


def given_away(value: object, outputs: str, prompt: str) -> list[str]:
    """The lines of ``outputs`` that print ``value`` (a number or a short string) as the
    answer to the exercise whose prompt (statement and stub) is ``prompt``.

    Examples:
        >>> out = "rank 0: holds 568,352 bytes of parameters\\n  most units holding full params: 3"
        >>> given_away(568352, out, "How many bytes of parameters?")
        ['rank 0: holds 568,352 bytes of parameters']
        >>> given_away(3, out, "How many blocks are there?")
        []
        >>> given_away(3, out, "most units holding full parameters at once in backward")
        ['most units holding full params: 3']
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return []
    forms, distinctive = _forms(value)
    patterns = [
        re.compile(rf"(?<![\w.,]){re.escape(f)}(?![\w]|[.,]\d)")
        if not isinstance(value, str)
        else re.compile(rf"(?<!\w){re.escape(f)}(?!\w)")
        for f in forms
    ]
    asked = _words(prompt)
    found = []
    for line in outputs.splitlines():
        if any(p.search(line) for p in patterns) and (
            distinctive or len(_words(line) & asked) >= MIN_SHARED_WORDS
        ):
            found.append(line.strip())
    return found


def outputs_above(cells: list[dict[str, Any]], index: int) -> str:
    """Every text output of the code cells before ``cells[index]``."""
    parts = []
    for cell in cells[:index]:
        for output in cell.get("outputs", []):
            if "text" in output:
                parts.append("".join(output["text"]))
            for kind, data in output.get("data", {}).items():
                if kind.startswith("text/"):
                    parts.append("".join(data) if isinstance(data, list) else str(data))
    return "\n".join(parts)


def prompt_of(cells: list[dict[str, Any]], exercise: Exercise) -> str:
    """The exercise's statement (the markdown cell before its stub) and its stub."""
    before = cells[exercise.stub_index - 1] if exercise.stub_index else None
    statement = source(before) if before and before["cell_type"] == "markdown" else ""
    return f"{statement}\n{exercise.stub}"
