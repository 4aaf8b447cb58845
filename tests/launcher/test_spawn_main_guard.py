"""A spawned launch from a script without ``if __name__ == "__main__":`` names the fix.

Each spawned rank imports the launching script again; unguarded, that import launches
again, multiprocessing refuses, and each rank died with status 1 while the launcher said
only "rank N exited with status 1 without returning a result".
"""

from __future__ import annotations

import py_compile
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

_HEAD = "from fsdp_guide import launch\nfrom fsdp_guide._examples import rank_and_sum\n\n"
_UNGUARDED = {
    "top-level": ("print(launch(rank_and_sum, 2, backend='gloo'))\n", 4),
    "main-called-at-top-level": (
        "def main():\n    return launch(rank_and_sum, 2, backend='gloo')\n\nmain()\n",
        7,
    ),
    "inside-a-with-block": (
        "import contextlib\nwith contextlib.suppress(KeyError):\n"
        "    print(launch(rank_and_sum, 2, backend='gloo'))\n",
        6,
    ),
}


def _run(script: Path, seconds: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, script.name],
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=seconds,
    )


@pytest.mark.parametrize("case", sorted(_UNGUARDED))
def test_an_unguarded_script_is_refused_before_any_rank_starts(tmp_path: Path, case: str) -> None:
    body, line = _UNGUARDED[case]
    script = tmp_path / "train.py"
    script.write_text(_HEAD + body)
    t0 = time.monotonic()
    done = _run(script)
    elapsed = time.monotonic() - t0
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("fsdp_guide.errors.LaunchError:"), done.stderr
    assert f"train.py, line {line}" in last
    assert 'if __name__ == "__main__":' in last
    # Refused in the launcher: no rank started, so multiprocessing never complained.
    assert "bootstrapping phase" not in done.stderr and "[rank" not in done.stderr
    assert elapsed < 60, elapsed


def test_without_the_source_the_ranks_say_why_they_died(tmp_path: Path) -> None:
    # Only the compiled script exists: the launcher cannot read where launch is called, the
    # ranks fail while importing the script, and both the ranks and the error name the fix.
    source = tmp_path / "train.py"
    source.write_text(_HEAD + _UNGUARDED["top-level"][0])
    compiled = tmp_path / "train.pyc"
    py_compile.compile(str(source), cfile=str(compiled), doraise=True)
    source.unlink()
    done = _run(compiled)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("fsdp_guide.errors.RankError:"), done.stderr
    assert "before it started" in last and 'if __name__ == "__main__":' in last
    assert "Each spawned rank starts by importing that script" in done.stderr  # a rank's


@pytest.mark.parametrize(
    ("source", "line", "guarded"),
    [
        ("launch()\n", 1, False),
        ("if __name__ == '__main__':\n    launch()\n", 2, True),
        ("if '__main__' == __name__ and True:\n    launch()\n", 2, True),
        ("for i in range(2):\n    launch()\n", 2, False),
        ("try:\n    launch()\nexcept KeyError:\n    pass\n", 2, False),
        ("try:\n    pass\nexcept KeyError:\n    launch()\n", 4, False),
        ("if True:\n    if __name__ == '__main__':\n        launch()\n", 3, True),
        ("def main():\n    launch()\n", 2, True),  # not top-level code
        (textwrap.dedent("class Job:\n    result = launch()\n"), 2, False),
        ("x = 1\n", 5, True),  # no statement there: no verdict
    ],
)
def test_is_guarded(source: str, line: int, guarded: bool) -> None:
    from fsdp_guide.launcher._main_guard import is_guarded

    assert is_guarded(source, line) is guarded
