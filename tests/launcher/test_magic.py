"""The %%distributed cell magic, driven through a real in-process IPython shell."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from IPython.core.interactiveshell import InteractiveShell

import fsdp_guide
from fsdp_guide import RankError
from fsdp_guide.errors import LaunchTimeout
from fsdp_guide.launcher.magic import parse_magic_line

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def shell() -> Iterator[Any]:
    ip = InteractiveShell.instance()
    ip.run_cell("%load_ext fsdp_guide", store_history=False)
    yield ip
    # A live shell makes launch() think it runs in a notebook: drop it for later tests.
    InteractiveShell.clear_instance()


def test_cell_runs_on_every_rank_and_gathers_by_rank(shell: Any) -> None:
    shell.run_cell("import torch, torch.distributed as dist\noffset = 10")
    result = shell.run_cell(
        "%%distributed --world-size 3 --backend gloo --gather mine total\n"
        "mine = rank + offset\n"
        "t = torch.tensor([float(mine)])\n"
        "dist.all_reduce(t)\n"
        "total = t.item()\n"
        "print('rank', rank, 'of', world_size)\n"
    )
    assert result.error_in_exec is None, result.error_in_exec
    assert shell.user_ns["mine"] == [10, 11, 12]
    assert shell.user_ns["total"] == [33.0, 33.0, 33.0]
    # the ranks' namespaces do not leak back
    assert "rank" not in shell.user_ns and "world_size" not in shell.user_ns
    assert "t" not in shell.user_ns


def test_a_failing_rank_fails_the_cell_with_its_traceback(shell: Any) -> None:
    result = shell.run_cell(
        "%%distributed --world-size 2 --timeout 60\n"
        "import torch.distributed as dist\n"
        "if rank == 1:\n"
        "    raise KeyError('missing shard')\n"
        "dist.barrier()\n"
    )
    err = result.error_in_exec
    assert isinstance(err, RankError) and err.rank == 1
    assert "KeyError: 'missing shard'" in str(err)
    assert "raise KeyError('missing shard')" in str(err)  # the cell's line, via linecache


def test_gathering_an_undefined_name_names_it(shell: Any) -> None:
    result = shell.run_cell("%%distributed --world-size 2 --gather nope\nx = 1\n")
    assert isinstance(result.error_in_exec, RankError)
    assert "did not define nope" in str(result.error_in_exec)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("--world-size two", "invalid int value"),
        ("--backend mpi", "invalid choice"),
        ("--gather 1x", "takes variable names"),
        ("--frobnicate", "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_options_are_refused_before_any_rank_starts(line: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_magic_line(line)


def test_bad_world_size_fails_the_cell_before_starting(shell: Any) -> None:
    result = shell.run_cell("%%distributed --world-size 0\nx = 1\n")
    assert isinstance(result.error_in_exec, ValueError)
    assert "--world-size must be >= 1, got 0" in str(result.error_in_exec)


def test_a_bad_timeout_names_the_magics_option(shell: Any) -> None:
    result = shell.run_cell("%%distributed --timeout 0\nx = 1\n")
    assert isinstance(result.error_in_exec, ValueError)
    assert "--timeout must be a positive number of seconds, got 0" in str(result.error_in_exec)


def test_a_timeout_names_the_magics_option_and_shows_the_cells_line_first(
    shell: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    t0 = time.monotonic()
    result = shell.run_cell(
        "%%distributed --world-size 2 --backend gloo --timeout 3\n"
        "import time, torch.distributed as dist\n"
        "if rank == 0:\n"
        "    dist.barrier()\n"
        "else:\n"
        "    time.sleep(60)\n"
    )
    elapsed = time.monotonic() - t0
    assert elapsed < 3 + 10, elapsed
    err = result.error_in_exec
    assert isinstance(err, LaunchTimeout)
    assert "Raise `--timeout` (seconds, on the %%distributed line)" in str(err)
    assert "timeout=" not in str(err)
    captured = capfd.readouterr()
    rank0 = [line for line in captured.err.splitlines() if line.startswith("[rank0] ")]
    start = next(i for i, line in enumerate(rank0) if "Current thread" in line)
    assert '"<distributed-cell-' in rank0[start + 1] and "line 3" in rank0[start + 1]
    assert any("machinery elided" in line for line in rank0[start : start + 8])
    # What the notebook shows for the error: the message, no frame of the package.
    assert "LaunchTimeout: ranks [0, 1] still running" in captured.out
    for frame in ("magic.py", "_launch.py", "_supervisor.py", "selectors.py"):
        assert frame not in captured.out


def test_a_failing_rank_shows_its_traceback_and_no_frame_of_the_magic(
    shell: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    result = shell.run_cell(
        "%%distributed --world-size 2 --backend gloo --timeout 60\n"
        "if rank == 1:\n"
        "    raise KeyError('missing shard')\n"
    )
    assert isinstance(result.error_in_exec, RankError)
    shown = capfd.readouterr().out
    assert "raise KeyError('missing shard')" in shown
    for frame in ("magic.py", "_launch.py", "_supervisor.py", "interactiveshell.py"):
        assert frame not in shown


def test_gathering_an_unpicklable_value_names_the_variable(shell: Any) -> None:
    result = shell.run_cell(
        "%%distributed --world-size 2 --backend gloo --gather ok fn\nok = rank\nfn = lambda: rank\n"
    )
    err = result.error_in_exec
    assert isinstance(err, RankError)
    assert "--gather fn: its value on rank" in str(err) and "cannot be pickled" in str(err)
    assert "ok" not in shell.user_ns and "fn" not in shell.user_ns


def test_gathering_an_object_of_a_class_defined_in_the_cell_says_where_to_define_it(
    shell: Any,
) -> None:
    result = shell.run_cell(
        "%%distributed --world-size 2 --backend gloo --gather shard\n"
        "class Shard:\n    pass\n"
        "shard = Shard()\n"
    )
    err = result.error_in_exec
    assert isinstance(err, RankError) and err.rank == 0
    assert "--gather shard: the value from rank 0 cannot be rebuilt in the notebook" in str(err)
    assert "define it in an ordinary cell" in str(err)


def test_a_cell_with_a_syntax_error_fails_before_any_rank_starts(
    shell: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ranks were started for a cell that does not compile")

    monkeypatch.setattr(fsdp_guide.launcher._supervisor, "start_ranks", refuse)
    result = shell.run_cell("%%distributed --world-size 2\nx = (\n")
    assert isinstance(result.error_in_exec, SyntaxError)
    assert "was never closed" in str(result.error_in_exec)


def test_an_optimizer_built_before_fsdp2_shard_fails_the_cell_with_the_fix(shell: Any) -> None:
    # Written from the docs alone: the optimizer first, then `model = shard(model, ...)`.
    shell.run_cell(
        "import torch\nfrom fsdp_guide.wrap import shard\n"
        "from fsdp_guide.models import TinyTransformer, TransformerConfig\n"
        "config = TransformerConfig(vocab_size=64, dim=32, n_heads=2, "
        "n_layers=2, seq_len=16)"
    )
    t0 = time.monotonic()
    result = shell.run_cell(
        "%%distributed --world-size 2 --backend gloo --timeout 60\n"
        "torch.manual_seed(0)\n"
        "model = TinyTransformer(config)\n"
        "optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)\n"
        'model = shard(model, engine="fsdp2")\n'
        "for step in range(3):\n"
        "    tokens = torch.randint(0, 64, (2, 16))\n"
        "    model(tokens).float().pow(2).mean().backward()\n"
        "    optimizer.step()\n"
        "    optimizer.zero_grad()\n"
    )
    elapsed = time.monotonic() - t0
    err = result.error_in_exec
    assert isinstance(err, RankError)
    message = str(err)
    assert (
        "OptimizerMismatchError: this optimizer was built before shard(..., engine='fsdp2')"
        in message
    )
    assert "Build the optimizer after wrapping" in message
    assert "optimizer.step()" in message  # the user's line, in the rank's traceback
    assert elapsed < 30, elapsed


def test_cell_sees_the_rank_device_as_device(shell: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Under NCCL rank_device() is the rank's GPU; "meta" stands in for it here, and the forked
    # ranks inherit the patch, so the cell must get the magic's answer, not a CPU default.
    import torch

    from fsdp_guide.launcher import magic

    monkeypatch.setattr(magic, "rank_device", lambda: torch.device("meta"))
    result = shell.run_cell(
        "%%distributed --world-size 2 --backend gloo --gather where\nwhere = str(device)\n"
    )
    assert result.error_in_exec is None, result.error_in_exec
    assert shell.user_ns["where"] == ["meta", "meta"]
