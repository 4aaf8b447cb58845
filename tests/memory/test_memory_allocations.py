"""track_allocations: the most bytes a block holds at once, replayed from the allocator's events."""

from __future__ import annotations

import io
import os

import pytest
import torch

from fsdp_guide.memory import track_allocations


def test_peak_and_net_of_plain_tensors() -> None:
    with track_allocations() as seen:
        a = torch.zeros(1000)
        b = torch.zeros(500)
        del a
        c = torch.ones(250)
    assert (seen.peak, seen.net) == (6000, 3000)
    assert seen.events >= 4
    del b, c


def test_storage_resizes_and_torch_load_are_counted() -> None:
    # FSDP frees and refills gathered parameters with resize_; torch.load makes storages
    # outside any op. Both go through the allocator, so both are seen.
    buffer = io.BytesIO()
    torch.save(torch.ones(1000), buffer)
    with track_allocations() as seen:
        grown = torch.zeros(2000)
        grown.untyped_storage().resize_(0)  # frees the 8,000 bytes
        grown.untyped_storage().resize_(400)
        buffer.seek(0)
        loaded = torch.load(buffer)
    assert (seen.peak, seen.net) == (8000, 400 + 4000)
    del grown, loaded


def test_only_what_the_block_allocated_is_followed(capfd: pytest.CaptureFixture[str]) -> None:
    # The profiler cannot tell the size of a block allocated before it started, so its
    # release is not counted: the figures are those of the block's own allocations. Torch's
    # C++ warning about it is expected and kept out of the error output; the rest passes.
    befores = [torch.zeros(5000 + i) for i in range(3)]
    with track_allocations() as seen:
        befores.clear()
        new = torch.zeros(10)
        os.write(2, b"another line\n")
    assert (seen.peak, seen.net) == (40, 40)
    err = capfd.readouterr().err
    assert "another line" in err
    assert "Memory block of unknown size" not in err
    del new


def test_older_garbage_is_freed_before_the_block() -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self
            self.data = torch.zeros(10_000)

    Cycle()  # unreachable, freed only by the collector
    with track_allocations() as seen:
        x = torch.zeros(10)
    assert seen.net == 40
    del x


def test_other_devices_are_refused() -> None:
    tracked = track_allocations("meta")
    with pytest.raises(ValueError, match="follows the CPU or a CUDA device, not meta"):
        tracked.__enter__()


@pytest.mark.gpu
def test_cuda_reads_the_caching_allocator() -> None:
    with track_allocations("cuda") as seen:
        a = torch.zeros(1024 * 1024, device="cuda")
        del a
    assert seen.peak >= 4 * 1024 * 1024
    assert seen.net == 0
