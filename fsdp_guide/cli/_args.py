"""argparse ``type=`` callables for the command line: counts, sizes, strategy lists (private).

argparse calls them and turns their :class:`argparse.ArgumentTypeError` into its own error,
which the one-line parser prints as one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*$")
_COUNT_SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


# Upper bounds: a world size beyond any cluster, and what one machine can start as processes.
MAX_WORLD_SIZE = 2**20  # what the planner handles (1,048,576 ranks)
MAX_LOCAL_RANKS = 128
MAX_TOKENS = 10**9  # a batch size or a sequence length
MAX_PARAMS = 1e15  # a thousand times the largest models trained


def shown(text: str, limit: int = 40) -> str:
    """``repr(text)``, shortened to about ``limit`` characters for a one-line message.

    Examples:
        >>> shown("9" * 401)
        "'99999999999999999999999999999999...' (401 characters)"
    """
    if len(text) <= limit:
        return repr(text)
    return f"{repr(text[: limit - 8])[:-1]}...' ({len(text)} characters)"


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A ``type=`` for integers of at least ``minimum`` (and at most ``maximum``, if given).

    Examples:
        >>> int_at_least(1)("3")
        3
        >>> int_at_least(1)("0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be an integer >= 1, got '0'
        >>> int_at_least(1, 64)("1" + "0" * 400)
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be an integer from 1 to 64, got '1000...' (401 characters)
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also past Python's 4300-digit limit
            value = minimum - 1
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {shown(text)}")
        return value

    return parse


def count(text: str) -> float:
    """A ``type=`` for a positive count such as ``7e9``, ``7B``, ``1.3B`` or ``350M``.

    Examples:
        >>> count("7e9"), count("1.5B")
        (7000000000.0, 1500000000.0)
        >>> count("1e400")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be a positive count such as 7e9, 7B or 350M, at most ...
    """
    match = _COUNT_RE.match(text)
    value = float(match.group(1)) * _COUNT_SCALE[match.group(2).lower()] if match else 0.0
    # Below 1 is no count of parameters; an overflow (1e400) reads as infinity.
    if not 1 <= value <= MAX_PARAMS:
        raise argparse.ArgumentTypeError(
            f"must be a positive count such as 7e9, 7B or 350M, at most 1e15, got {shown(text)}"
        )
    return value


def positive_size(text: str) -> int:
    """A ``type=`` for a memory size with its unit, such as ``80GB`` or ``24GiB``, in bytes.

    A number alone is refused: ``80`` could be bytes or gigabytes, and read as bytes every
    strategy would fail to fit. ``KB``/``MB``/``GB``/``TB`` are powers of 1000,
    ``KiB``/``MiB``/``GiB``/``TiB`` powers of 1024, ``B`` bytes.

    Examples:
        >>> positive_size("80GB"), positive_size("1.5 GiB")
        (80000000000, 1610612736)
        >>> positive_size("80")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: '80' has no unit; write e.g. 80GB (10^9 bytes) or 80GiB ...
        >>> positive_size("0GB")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be positive, got '0GB'
    """
    from fsdp_guide.memory import parse_size

    if not re.search(r"[A-Za-z]\s*$", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} has no unit; write e.g. 80GB (10^9 bytes) or 80GiB (2^30 bytes); "
            "units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return size


def input_spec(text: str) -> object:
    """A ``type=`` for a model input ``name:dtype[dims]`` (:func:`fsdp_guide.inputs.parse_input`).

    Examples:
        >>> str(input_spec("input_ids:int64[B,S]"))
        'input_ids:int64[B,S]'
        >>> input_spec("input_ids")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: cannot read 'input_ids' as an input; write name:dtype[dims], ...
    """
    from fsdp_guide.errors import PlanError
    from fsdp_guide.inputs import parse_input

    try:
        return parse_input(text)
    except PlanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _strategies(text: str, cuda: bool | None, installed: bool = True) -> list[str]:
    from fsdp_guide.catalog import check_strategies

    names = [n.strip() for n in text.split(",") if n.strip()]
    try:
        specs = check_strategies(names, cuda=cuda, installed=installed)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return [spec.name for spec in specs]


def strategy_list(text: str) -> list[str]:
    """A ``type=`` for comma-separated strategy names (or aliases) to run on this machine.

    Examples:
        >>> strategy_list("ddp, fsdp1")
        ['ddp', 'fsdp']
        >>> strategy_list("ddp,zero4")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: unknown strategy 'zero4'; choose from ddp, zero1, oss, ...
    """
    return _strategies(text, cuda=None)


def catalog_names(text: str) -> list[str]:
    """A ``type=`` for comma-separated strategy names to plan: CUDA-only ones are fine here.

    Examples:
        >>> catalog_names("fsdp1,fairscale_fsdp")
        ['fsdp', 'fairscale_fsdp']
        >>> catalog_names("fsdp,fsdp1")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: strategy 'fsdp' is given twice (as 'fsdp1'); name each ...
    """
    # A plan allocates nothing: no GPU needed, and no DeepSpeed either.
    return _strategies(text, cuda=True, installed=False)


def import_path(text: str) -> str:
    """A ``type=`` for ``package.module:name`` (imported when the command runs).

    Examples:
        >>> import_path("fsdp_guide.models:TinyTransformer")
        'fsdp_guide.models:TinyTransformer'
        >>> import_path("TinyTransformer")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be package.module:name, got 'TinyTransformer'
    """
    module, colon, name = text.partition(":")
    if not (colon and module and name.isidentifier()):
        raise argparse.ArgumentTypeError(f"must be package.module:name, got {text!r}")
    return text


def key_value(text: str) -> tuple[str, object]:
    """A ``type=`` for ``key=value``; the value read as a Python literal, else kept as text.

    Examples:
        >>> key_value("n_layers=80"), key_value("name=gpt"), key_value("ratio=0.5")
        (('n_layers', 80), ('name', 'gpt'), ('ratio', 0.5))
        >>> key_value("80")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be key=value, got '80'
    """
    import ast

    key, equals, raw = text.partition("=")
    if not (equals and key.strip().isidentifier()):
        raise argparse.ArgumentTypeError(f"must be key=value, got {text!r}")
    try:
        value: object = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        value = raw.strip()
    return key.strip(), value


def fraction(text: str) -> float:
    """A ``type=`` for a share from 0 (included) to 1 (excluded).

    Examples:
        >>> fraction("0.1")
        0.1
        >>> fraction("1")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be a number from 0 to below 1, got '1'
    """
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to below 1, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A ``type=`` for a duration in seconds, above zero and at most a day.

    Examples:
        >>> seconds("2.5")
        2.5
        >>> seconds("0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be a number of seconds above 0, at most 86400, got '0'
    """
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 86400:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds above 0, at most 86400, got {shown(text)}"
        )
    return value


#: The forms ``--wrap`` takes, named in each of its errors.
WRAP_FORMS = (
    "blocks, root, min_params=N (N such as 1e6 or 1M) or package.module:Class "
    "(several comma-separated)"
)


@dataclass(frozen=True)
class WrapArg:
    """What ``--wrap`` asked for, read but not imported yet.

    Attributes:
        text: The value as given.
        rule: ``"blocks"``, ``"root"``, ``"min_params"`` or ``"layers"``.
        min_params: The smallest unit with ``"min_params"``.
        classes: The ``package.module:Class`` paths with ``"layers"``.
    """

    text: str
    rule: Literal["blocks", "root", "min_params", "layers"]
    min_params: int = 0
    classes: tuple[str, ...] = ()


def wrap_policy(text: str) -> WrapArg:
    """A ``type=`` for ``--wrap``: ``blocks``, ``root``, ``min_params=N`` or layer classes.

    The classes are imported when the command runs.

    Examples:
        >>> wrap_policy("min_params=1M")
        WrapArg(text='min_params=1M', rule='min_params', min_params=1000000, classes=())
        >>> wrap_policy("a.b:Layer, c:Norm").classes
        ('a.b:Layer', 'c:Norm')
        >>> wrap_policy("min_params=0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: min_params=N takes a whole count of at least 1 ...
        >>> wrap_policy("layers")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be blocks, root, min_params=N (N such as 1e6 or 1M) ...
    """
    value = text.strip()
    if value == "blocks":
        return WrapArg(text=value, rule="blocks")
    if value == "root":
        return WrapArg(text=value, rule="root")
    key, equals, raw = value.partition("=")
    if equals and key.strip() == "min_params":
        try:
            number = count(raw)
        except argparse.ArgumentTypeError:
            number = 0.0
        if number < 1 or not number.is_integer():  # SizePolicy counts whole elements
            raise argparse.ArgumentTypeError(
                f"min_params=N takes a whole count of at least 1 such as 1e6 or 1M, got "
                f"{shown(text)}; --wrap takes {WRAP_FORMS}"
            )
        return WrapArg(text=value, rule="min_params", min_params=int(number))
    paths = tuple(part.strip() for part in value.split(","))
    for path in paths:
        module, colon, name = path.partition(":")
        if not (colon and module and name.isidentifier()):
            raise argparse.ArgumentTypeError(f"must be {WRAP_FORMS}, got {shown(text)}")
    return WrapArg(text=value, rule="layers", classes=paths)


def schedule_name(text: str) -> str:
    """A ``type=`` for a pipeline schedule: torch's name, any case.

    Examples:
        >>> schedule_name("gpipe")
        'GPipe'
    """
    from fsdp_guide.errors import PlanError
    from fsdp_guide.memory import pipeline_schedule

    try:
        return pipeline_schedule(text, ranks=1, microbatches=1).name
    except PlanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
