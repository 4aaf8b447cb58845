"""The ``%%distributed`` cell magic: run a notebook cell on N ranks.

Load it with ``%load_ext fsdp_guide``. The cell body runs on each rank in a forked copy of
the kernel, so it sees the notebook's imports and variables, with ``rank``,
``world_size`` and ``device`` (the rank's device: its GPU under NCCL, the CPU under gloo)
defined and ``torch.distributed`` initialised. ``--gather NAME`` brings a
variable back into the notebook as a list indexed by rank.

::

    %%distributed --world-size 2 --gather loss
    loss = train_one_epoch(rank, world_size)
"""

from __future__ import annotations

import argparse
import linecache
import pickle
import shlex
from typing import Any

from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, magics_class

from fsdp_guide.errors import LaunchError, RankError
from fsdp_guide.launcher._launch import launch
from fsdp_guide.launcher._process_group import rank_device

# Readers use the magic (``%%distributed``), not its class: nothing here is called by name.
__all__: list[str] = []

_CELL_FILENAME = "<distributed-cell-{n}>"
_cell_counter = 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%%distributed", add_help=False, exit_on_error=False)
    parser.add_argument("--world-size", "-n", type=int, default=2)
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--gather", nargs="+", default=[], metavar="NAME")
    return parser


def parse_magic_line(line: str) -> argparse.Namespace:
    """Parse the options of a ``%%distributed`` line.

    Raises:
        ValueError: For an unknown option or a malformed value, naming the valid options.

    Examples:
        >>> opts = parse_magic_line("--world-size 4 --backend gloo --gather loss acc")
        >>> opts.world_size, opts.backend, opts.gather
        (4, 'gloo', ['loss', 'acc'])
        >>> parse_magic_line("--world 4 --bogus")
        Traceback (most recent call last):
        ...
        ValueError: %%distributed: unrecognized arguments: --bogus; valid options: ...
    """
    parser = _parser()
    try:
        opts, extra = parser.parse_known_args(shlex.split(line))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"%%distributed: {exc}; valid options: {_usage(parser)}") from None
    if extra:
        raise ValueError(
            f"%%distributed: unrecognized arguments: {' '.join(extra)}; "
            f"valid options: {_usage(parser)}"
        )
    if opts.world_size < 1:
        raise ValueError(f"%%distributed: --world-size must be >= 1, got {opts.world_size}")
    if not 0 < opts.timeout < float("inf"):
        raise ValueError(
            f"%%distributed: --timeout must be a positive number of seconds, got {opts.timeout}"
        )
    for name in opts.gather:
        if not name.isidentifier():
            raise ValueError(f"%%distributed: --gather takes variable names, got {name!r}")
    return opts


def _usage(parser: argparse.ArgumentParser) -> str:
    return parser.format_usage().replace("usage: ", "").strip()


_PLAIN_DATA = "numbers, strings, lists, dicts, CPU tensors"


def _run_cell(
    rank: int, world_size: int, code: Any, namespace: dict[str, Any], gather: list[str]
) -> dict[str, bytes]:
    # We are in a forked child: editing the copied namespace cannot affect the notebook.
    namespace["rank"] = rank
    namespace["world_size"] = world_size
    namespace["device"] = rank_device()
    exec(code, namespace)
    missing = [name for name in gather if name not in namespace]
    if missing:
        raise NameError(f"--gather: the cell did not define {', '.join(missing)} on rank {rank}")
    # Pickled one by one here, so that a value that cannot travel is named.
    gathered = {}
    for name in gather:
        try:
            gathered[name] = pickle.dumps(namespace[name], protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"--gather {name}: its value on rank {rank} cannot be pickled "
                f"({type(exc).__name__}: {exc}); gather plain data ({_PLAIN_DATA})"
            ) from None
    return gathered


def _unpickle_gathered(name: str, rank: int, data: bytes) -> Any:
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise RankError(
            f"--gather {name}: the value from rank {rank} cannot be rebuilt in the notebook "
            f"({type(exc).__name__}: {exc}). A class defined inside the %%distributed cell "
            "exists only on the ranks: define it in an ordinary cell run before, or gather "
            f"plain data ({_PLAIN_DATA}).",
            rank=rank,
        ) from None


def run_cell_on_ranks(
    cell: str,
    namespace: dict[str, Any],
    world_size: int = 2,
    backend: str = "auto",
    timeout: float = 300.0,
    gather: list[str] | None = None,
) -> dict[str, list[Any]]:
    """Run ``cell`` on forked ranks and return each gathered variable as a per-rank list.

    The cell's source is registered with :mod:`linecache` before forking, so tracebacks
    from a failing rank show the offending line.

    Args:
        cell: Python source of the cell body.
        namespace: The notebook's user namespace (read, not modified, by the ranks).
        world_size: Number of ranks.
        backend: ``"auto"``, ``"gloo"`` or ``"nccl"``.
        timeout: Seconds before all ranks are stopped.
        gather: Names of variables to bring back.

    Returns:
        ``{name: [value on rank 0, value on rank 1, ...]}`` for each gathered name.

    Raises:
        SyntaxError: The cell does not compile (raised before any rank starts).
        fsdp_guide.RankError: A rank failed (its traceback is in the message), or a gathered
            value cannot be pickled on its rank or rebuilt here (the message names it).

    Examples:
        >>> run_cell_on_ranks("x = rank * 10", {}, world_size=2, backend="gloo", gather=["x"])
        {'x': [0, 10]}
    """
    global _cell_counter
    _cell_counter += 1
    filename = _CELL_FILENAME.format(n=_cell_counter)
    code = compile(cell, filename, "exec")
    linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
    names = list(gather or [])
    results = launch(
        _run_cell,
        world_size=world_size,
        args=(code, namespace, names),
        backend=backend,  # type: ignore[arg-type]
        timeout=timeout,
        start_method="fork",
    )
    return {
        name: [_unpickle_gathered(name, rank, r[name]) for rank, r in enumerate(results)]
        for name in names
    }


@magics_class
class DistributedMagics(Magics):
    """IPython magics of fsdp-guide; registered by ``%load_ext fsdp_guide``.

    Args:
        shell: The IPython shell the magics run in (``get_ipython()``).
    """

    # Our own constructor, so that its documented signature names a class importable at run
    # time: IPython's ``Magics.__init__`` annotates ``shell`` with a name it imports only
    # under ``TYPE_CHECKING``, which the API docs cannot resolve.
    def __init__(self, shell: InteractiveShell | None = None) -> None:
        super().__init__(shell=shell)

    @cell_magic
    def distributed(self, line: str, cell: str) -> None:
        """%%distributed [--world-size N] [--backend B] [--timeout S] [--gather NAME ...]."""
        __tracebackhide__ = True  # IPython: the rank's traceback is in the message
        opts = parse_magic_line(line)
        shell = self.shell
        assert shell is not None, "the magic is used outside IPython"
        try:
            gathered = run_cell_on_ranks(
                cell,
                shell.user_ns,
                world_size=opts.world_size,
                backend=opts.backend,
                timeout=opts.timeout,
                gather=opts.gather,
            )
        except LaunchError as err:
            raise _in_magic_terms(err) from None
        except ValueError as err:  # refused before any rank started, in launch()'s terms
            raise ValueError(_magic_options(str(err))) from None
        shell.user_ns.update(gathered)


# launch()'s argument names, as this magic's options.
_OPTION_NAMES = (
    ("`timeout=`", "`--timeout` (seconds, on the %%distributed line)"),
    ("backend='gloo'", "--backend gloo"),
    ("backend='nccl'", "--backend nccl"),
    ("world_size", "--world-size"),
)


def _magic_options(text: str) -> str:
    for launch_name, option in _OPTION_NAMES:
        text = text.replace(launch_name, option)
    return text


def _in_magic_terms(err: LaunchError) -> LaunchError:
    """``err`` worded with the magic's options, shown in IPython as its message alone.

    The launcher's frames say nothing about the cell, and a rank's traceback is already in
    the message; IPython shows an exception's ``_render_traceback_()`` instead of frames.
    """
    text = _magic_options(str(err))
    if text != str(err):
        err.args = (text, *err.args[1:])
    name = f"{type(err).__module__}.{type(err).__qualname__}"
    err._render_traceback_ = lambda: [f"{name}: {text}"]  # type: ignore[attr-defined]
    return err.with_traceback(None)
