"""Safe writes, safe reads and clear errors of fsdp_guide.checkpoint."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import CONFIG, build, differences, snapshot, train
from torch import nn

from fsdp_guide import RankError, checkpoint, launch
from fsdp_guide.checkpoint import CheckpointError
from fsdp_guide.checkpoint import _io as checkpoint_io
from fsdp_guide.models import MLP, TinyTransformer, TransformerConfig


class ExplodingTensor(torch.Tensor):
    """A tensor whose pickling fails: a save that reaches it stops half-way through."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError("pickling exploded half-way")


class CodePayload:
    """Unpickling this object opens (so creates) ``marker``: code run by the loader."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def trained_module() -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optimizer = build("module", seed=0)
    train(model, optimizer, start=0, steps=1)
    return model, optimizer


def fake_full_file(path: Path, model_state: Any) -> None:
    payload = {
        "format": checkpoint_io.FULL_FORMAT,
        "version": 1,
        "strategy": "module",
        "world_size": 1,
        "optimizer_keys": "name",
        "model": model_state,
        "optimizer": None,
        "extra": None,
    }
    torch.save(payload, path)


# --- safe writes -----------------------------------------------------------------------


def test_save_failing_half_way_leaves_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    model, optimizer = trained_module()
    checkpoint.save(path, model, optimizer, extra={"step": 1})
    before = path.read_bytes()
    saved = snapshot(model, optimizer, "module")

    train(model, optimizer, start=1, steps=1)
    model.register_buffer("exploding", torch.zeros(3).as_subclass(ExplodingTensor))
    with pytest.raises(CheckpointError, match="pickling exploded half-way"):
        checkpoint.save(path, model, optimizer, extra={"step": 2})

    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no temporary left
    fresh, fresh_optimizer = build("module", seed=1)
    assert checkpoint.load(path, fresh, fresh_optimizer) == {"step": 1}
    assert differences(saved, snapshot(fresh, fresh_optimizer, "module")) == []


def save_twice_second_fails_on_rank_1(rank: int, world_size: int, path: str) -> Any:
    """Save a sharded checkpoint; make rank 1's write of the next one die half-way."""
    model, optimizer = build("fsdp2", seed=0)
    train(model, optimizer, start=0, steps=1)
    checkpoint.save(path, model, optimizer, kind="sharded", extra={"step": 1})
    saved = snapshot(model, optimizer, "fsdp2")
    train(model, optimizer, start=1, steps=1)
    if rank == 1:
        real_save = torch.save

        def save_half(obj: Any, handle: Any) -> None:
            whole = io.BytesIO()
            real_save(obj, whole)
            handle.write(whole.getvalue()[: len(whole.getvalue()) // 2])
            raise OSError("disk full")

        checkpoint_io.torch.save = save_half  # only in this forked rank
    error = ""
    try:
        checkpoint.save(path, model, optimizer, kind="sharded", extra={"step": 2})
    except CheckpointError as exc:
        error = str(exc)
    if rank == 1:
        checkpoint_io.torch.save = real_save
    fresh, fresh_optimizer = build("fsdp2", seed=1)
    extra = checkpoint.load(path, fresh, fresh_optimizer)
    return {
        "error": error,
        "extra": extra,
        "differences": differences(saved, snapshot(fresh, fresh_optimizer, "fsdp2")),
    }


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sharded_save_failing_on_one_rank_leaves_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    results = launch(
        save_twice_second_fails_on_rank_1,
        2,
        args=(str(path),),
        backend="gloo",
        start_method="fork",
    )
    for result in results:  # every rank raised, not only the one whose disk failed
        assert result["error"].startswith("rank 1: OSError: disk full")
        assert result["extra"] == {"step": 1}
        assert result["differences"] == []
    index = json.loads((path / "index.json").read_text())
    data_dirs = [p.name for p in path.iterdir() if p.is_dir()]
    assert data_dirs == [index["extra"].split("/")[0]]  # the failed attempt was removed


# --- safe reads ------------------------------------------------------------------------


def test_payload_that_runs_code_is_refused_and_never_runs(tmp_path: Path) -> None:
    control_marker, marker = tmp_path / "control-ran", tmp_path / "payload-ran"
    control, crafted = tmp_path / "control.pt", tmp_path / "crafted.pt"
    fake_full_file(control, {"w": CodePayload(control_marker)})
    fake_full_file(crafted, {"w": CodePayload(marker)})
    torch.load(control, weights_only=False)  # proves the payload really runs code
    assert control_marker.exists()

    with pytest.raises(CheckpointError, match=r"refused to load .*crafted.pt.*could run code"):
        checkpoint.load(crafted, nn.Linear(2, 2))
    assert not marker.exists()


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank FSDP2 sharded checkpoint, saved once; tests damage copies of it."""
    path = tmp_path_factory.mktemp("sharded") / "ckpt"
    launch(save_sharded_fsdp2, 2, args=(str(path),), backend="gloo", start_method="fork")
    return path


def save_sharded_fsdp2(rank: int, world_size: int, path: str) -> None:
    model, optimizer = build("fsdp2", seed=0)
    train(model, optimizer, start=0, steps=1)
    checkpoint.save(path, model, optimizer, kind="sharded", extra={"step": 1})


@pytest.fixture
def damaged(sharded_checkpoint: Path, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    copy = tmp_path / "ckpt"
    shutil.copytree(sharded_checkpoint, copy)
    return copy, json.loads((copy / "index.json").read_text())


def data_files(index: dict[str, Any]) -> list[str]:
    """The DCP data files an index lists (one per saving rank), sorted."""
    return sorted(name for name in index["files"] if name.endswith(".distcp"))


# --- clear errors ----------------------------------------------------------------------


@pytest.mark.slow
def test_missing_shard(damaged: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, index = damaged
    (path / data_files(index)[1]).unlink()
    with pytest.raises(CheckpointError, match=r"missing checkpoint file data-\w+/__1_0\.distcp"):
        checkpoint.load(path, TinyTransformer(CONFIG))
    with pytest.raises(CheckpointError, match="missing checkpoint file"):
        checkpoint.consolidate(path, tmp_path / "full.pt")


@pytest.mark.slow
def test_truncated_shard(damaged: tuple[Path, dict[str, Any]]) -> None:
    path, index = damaged
    shard = path / data_files(index)[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(
        CheckpointError, match=r"__0_0\.distcp .* is truncated or changed: 100 bytes"
    ):
        checkpoint.load(path, TinyTransformer(CONFIG))


@pytest.mark.slow
def test_shard_changed_after_saving(damaged: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, index = damaged
    shard = path / data_files(index)[0]
    data = bytearray(shard.read_bytes())
    data[-30] ^= 0xFF  # same size, other bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        checkpoint.consolidate(path, tmp_path / "full.pt")


@pytest.mark.slow
def test_unfinished_sharded_save_has_no_index(damaged: tuple[Path, dict[str, Any]]) -> None:
    path, _ = damaged
    (path / "index.json").unlink()
    with pytest.raises(CheckpointError, match=r"no index.json in .*not a finished sharded"):
        checkpoint.load(path, TinyTransformer(CONFIG))


def load_into_zero(rank: int, world_size: int, path: str) -> None:
    model, optimizer = build("zero1", seed=0)
    checkpoint.load(path, model, optimizer)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sharded_checkpoint_into_a_strategy_dcp_cannot_fill(
    damaged: tuple[Path, dict[str, Any]],
) -> None:
    path, _ = damaged
    with pytest.raises(
        RankError,
        match=r"holds 'fsdp2' shards, which load at any world size into PyTorch FSDP1 or FSDP2, "
        r"a plain module or DDP; this model is 'zero1': consolidate it \(python -m fsdp_guide "
        r"consolidate .*\) and load the full file",
    ):
        launch(load_into_zero, 1, args=(str(path),), backend="gloo", start_method="fork")


def test_sharded_checkpoint_of_format_1_is_refused(tmp_path: Path) -> None:
    # Format 1 wrote PyTorch FSDP shards as rank<N>.pt files, which this version does not read.
    index = {
        "format": "fsdp_guide.sharded",
        "version": 1,
        "strategy": "fsdp2",
        "world_size": 2,
        "shards": ["data-0123456789ab/rank0.pt", "data-0123456789ab/rank1.pt"],
        "extra": "data-0123456789ab/extra.pt",
        "files": {},
    }
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"first sharded format \(rank<N>\.pt files\)"):
        checkpoint.load(tmp_path / "ckpt", TinyTransformer(CONFIG))
    with pytest.raises(CheckpointError, match=r"first sharded format"):
        checkpoint.consolidate(tmp_path / "ckpt", tmp_path / "full.pt")


def load_sharded_into_wider_model(rank: int, world_size: int, path: str) -> None:
    model, optimizer = build("fsdp2", seed=0)
    checkpoint.save(path, model, optimizer, kind="sharded")
    wider = TransformerConfig(vocab_size=32, dim=16, n_heads=2, n_layers=3, seq_len=8, mlp_ratio=4)
    other, other_optimizer = build("fsdp2", seed=0, config=wider)
    checkpoint.load(path, other, other_optimizer)  # raises on every rank


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sharded_checkpoint_into_a_different_model_lists_the_differences(tmp_path: Path) -> None:
    with pytest.raises(
        RankError,
        match=r"CheckpointError: the checkpoint does not fit this model: in the model but not "
        r"in the checkpoint: blocks\.2\.fc1\.bias.*shapes differ: blocks\.0\.fc1\.bias: "
        r"checkpoint \[32\] vs model \[64\]",
    ):
        launch(
            load_sharded_into_wider_model,
            2,
            args=(str(tmp_path / "ckpt"),),
            backend="gloo",
            start_method="fork",
        )


@pytest.mark.parametrize("keep", [1, 10, 0.5, -200], ids=["1B", "10B", "half", "all-200B"])
def test_truncated_full_file(tmp_path: Path, keep: float) -> None:
    # A file cut to a byte or two is not a zip archive: it must read as truncated, not as
    # a refused pickle payload.
    path = tmp_path / "ckpt.pt"
    model, optimizer = trained_module()
    checkpoint.save(path, model, optimizer)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(CheckpointError, match=r"ckpt.pt is truncated or corrupt"):
        checkpoint.load(path, *build("module", seed=1))


def test_parameter_names_differ(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, TinyTransformer(CONFIG))
    with pytest.raises(
        CheckpointError,
        match=r"in the model but not in the checkpoint: net\.0\.bias, net\.0\.weight.*"
        r"in the checkpoint but not in the model: blocks\.0\.fc1\.bias",
    ):
        checkpoint.load(path, MLP(in_features=16, hidden=8, depth=1, out_features=4))


def test_parameter_shapes_differ(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, TinyTransformer(CONFIG))
    wider = TransformerConfig(vocab_size=32, dim=32, n_heads=2, n_layers=2, seq_len=8, mlp_ratio=2)
    with pytest.raises(
        CheckpointError,
        match=r"shapes differ: blocks\.0\.fc1\.bias: checkpoint \[32\] vs model \[64\]",
    ):
        checkpoint.load(path, TinyTransformer(wider))


def test_optimizer_state_missing_from_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    model, optimizer = trained_module()
    checkpoint.save(path, model)
    with pytest.raises(CheckpointError, match=r"holds no optimizer state.*optimizer=None"):
        checkpoint.load(path, model, optimizer)


def test_foreign_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match="not a full checkpoint written by fsdp_guide"):
        checkpoint.load(path, nn.Linear(2, 1))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kind": "everything"}, ValueError, "kind must be 'full' or 'sharded'"),
        ({"kind": "sharded"}, ValueError, "kind='sharded' is for strategies that shard"),
        ({"extra": {"when": object()}}, TypeError, r"extra\['when'\] is a object"),
        ({"extra": {"rng": [torch.zeros(1), {1.5: 2}]}}, TypeError, "has a key of type float"),
    ],
)
def test_bad_save_arguments_raise_before_writing(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    path = tmp_path / "ckpt.pt"
    with pytest.raises(error, match=match):
        checkpoint.save(path, nn.Linear(2, 1), **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_model_that_is_not_a_module() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got dict"):
        checkpoint.save("x.pt", {"w": torch.zeros(1)})  # type: ignore[arg-type]


def test_failed_load_leaves_the_model_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, *trained_module())
    model = TinyTransformer(CONFIG)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fewer = [p for n, p in model.named_parameters() if not n.startswith("blocks.0.")]
    optimizer = torch.optim.AdamW(fewer)
    with pytest.raises(
        CheckpointError,
        match=r"in the checkpoint but not in the optimizer's parameters: blocks\.0\.fc1\.bias",
    ):
        checkpoint.load(path, model, optimizer)
    assert differences(before, dict(model.state_dict())) == []
    assert optimizer.state_dict()["state"] == {}


def save_sharded_into(rank: int, world_size: int, path: str) -> None:
    model, optimizer = build("fsdp2", seed=0)
    checkpoint.save(path, model, optimizer, kind="sharded")


@pytest.mark.timeout(120)
def test_sharded_save_refuses_a_directory_holding_other_files(tmp_path: Path) -> None:
    # A save removes older data-* directories: it must never touch what it did not write.
    (tmp_path / "data-raw").mkdir()
    (tmp_path / "data-raw" / "keep.txt").write_text("the user's data")
    (tmp_path / "notes.txt").write_text("notes")
    with pytest.raises(
        RankError,
        match=r"ValueError: .* holds data-raw, notes\.txt, which a sharded checkpoint does not "
        r"write: choose a new or empty directory",
    ):
        launch(save_sharded_into, 1, args=(str(tmp_path),), backend="gloo", start_method="fork")
    assert (tmp_path / "data-raw" / "keep.txt").read_text() == "the user's data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data-raw", "notes.txt"]


def load_name_keyed_into_fairscale_fsdp(rank: int, world_size: int, path: str) -> None:
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    # Built on the CPU only to be recognised: the error comes before any gather.
    model = FullyShardedDataParallel(nn.Linear(2, 1), compute_device=torch.device("cpu"))
    checkpoint.load(path, model, torch.optim.AdamW(model.parameters()))


@pytest.mark.timeout(120)
def test_name_keyed_optimizer_state_is_refused_by_fairscale_fsdp(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    layer = nn.Linear(2, 1)
    checkpoint.save(path, layer, torch.optim.AdamW(layer.parameters()))
    with pytest.raises(
        RankError,
        match=r"holds a 'module' optimizer state, keyed by parameter name; FairScale FSDP "
        r"loads only its own optimizer state: pass optimizer=None",
    ):
        launch(
            load_name_keyed_into_fairscale_fsdp,
            1,
            args=(str(path),),
            backend="gloo",
            start_method="fork",
        )
