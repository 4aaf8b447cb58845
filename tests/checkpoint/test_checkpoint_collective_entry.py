"""save and load called on some ranks only fail within seconds, naming the mistake.

The DDP tutorials' ``if rank == 0: save(...)`` used to hang for the whole launch timeout
(with a barrier after it) or die on gloo's "Connection closed by peer" (without one).
"""

from __future__ import annotations

import time
from pathlib import Path

import launch_targets as targets
import pytest

import fsdp_guide.checkpoint  # noqa: F401  (imported once here, not in each forked rank)
from fsdp_guide import RankError, launch

pytestmark = pytest.mark.timeout(60)

_ENTRY_BOUND_S = 10.0


@pytest.mark.parametrize("barrier", [True, False], ids=["then-barrier", "no-barrier"])
def test_save_on_rank_zero_only_fails_fast_naming_the_mistake(
    tmp_path: Path, barrier: bool
) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(
            targets.save_on_rank_zero_only,
            2,
            args=(str(tmp_path / "ckpt.pt"), barrier),
            backend="gloo",
            start_method="fork",
            timeout=120,
        )
    elapsed = time.monotonic() - t0
    message = str(info.value)
    assert info.value.rank == 0
    assert "CollectiveCallError" in message
    assert "every rank must call it" in message
    assert "`if rank == 0:`" in message
    assert "ranks [1]" in message
    assert elapsed < _ENTRY_BOUND_S, elapsed
    assert not (tmp_path / "ckpt.pt").exists()


def test_load_on_rank_zero_only_fails_fast(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError, match="fsdp_guide.checkpoint.load is collective"):
        launch(
            targets.load_on_rank_zero_only,
            2,
            args=(str(tmp_path / "ckpt.pt"),),
            backend="gloo",
            start_method="fork",
            timeout=120,
        )
    elapsed = time.monotonic() - t0
    assert elapsed < _ENTRY_BOUND_S, elapsed


def test_entry_timeout_must_be_a_positive_number(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_guide.launcher._entry import entry_timeout

    monkeypatch.setenv("FSDP_GUIDE_ENTRY_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="FSDP_GUIDE_ENTRY_TIMEOUT='soon'"):
        entry_timeout()
    monkeypatch.setenv("FSDP_GUIDE_ENTRY_TIMEOUT", "12.5")
    assert entry_timeout() == 12.5
