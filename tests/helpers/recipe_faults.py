"""Run a fine-tuning recipe under torchrun; on the first start, rank 0 dies after a given step.

``torchrun ... recipe_faults.py RECIPE.py ARGS...`` runs ``RECIPE.py ARGS...`` unchanged in
every worker, except that rank 0, on the first start only (``RECIPE_FAULTS`` names a
directory where a marker says the fault has fired), kills itself with SIGKILL as soon as it
has printed the line of step ``RECIPE_KILL_AFTER``: that step has trained (its optimizer
step is done) and was not saved. torchrun then stops the other rank and starts both again.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any, TextIO


class _DieAfterLine:
    """A stdout that passes every write on and dies once it has passed on ``prefix``."""

    def __init__(self, stream: TextIO, prefix: str, marker: Path) -> None:
        self._stream, self._prefix, self._marker = stream, prefix, marker

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        if text.startswith(self._prefix):
            self._stream.flush()
            self._marker.write_text(text)
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


if __name__ == "__main__":
    marker = Path(os.environ["RECIPE_FAULTS"]) / "killed"
    if os.environ["RANK"] == "0" and not marker.exists():
        step = os.environ["RECIPE_KILL_AFTER"]
        sys.stdout = _DieAfterLine(sys.stdout, f"step {step}: ", marker)  # type: ignore[assignment]
    script = sys.argv[1]
    sys.path.insert(0, str(Path(script).parent))
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
