"""DeepSpeed ZeRO as strategies: preflight, training without a compiler, checkpoints.

The training runs happen in one subprocess whose PATH holds no C++ compiler and whose torch
extension cache is empty, so any JIT build DeepSpeed attempted would fail the run: the same
run shows ZeRO-1/2/3 (and the offload variants) train without one and match plain Adam.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdp_guide.deepspeed._preflight as preflight_module
from fsdp_guide.catalog import STRATEGIES, check_strategies
from fsdp_guide.cli import main
from fsdp_guide.deepspeed import compiled_ops, preflight, zero_config
from fsdp_guide.errors import MissingRequirementError
from fsdp_guide.launcher import launch
from fsdp_guide.models import build_model, loss_fn, synthetic_batch

TESTS = Path(__file__).resolve().parents[1] / "helpers"
DEEPSPEED = [name for name, spec in STRATEGIES.items() if spec.engine == "deepspeed"]
STEPS = 3


@functools.cache
def adam_losses(steps: int = STEPS) -> list[float]:
    """Single-process torch Adam on the whole batch: what every ZeRO stage must reproduce."""
    torch.manual_seed(0)
    model = build_model("transformer")
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        loss = loss_fn(model, synthetic_batch("transformer", 8, step))
        loss.backward()
        adam.step()
        adam.zero_grad()
        losses.append(loss.item())
    return losses


def test_importing_the_package_does_not_import_deepspeed() -> None:
    code = (
        "import sys, fsdp_guide, fsdp_guide.deepspeed, fsdp_guide.catalog, fsdp_guide.compare, "
        "fsdp_guide.checkpoint, fsdp_guide.cli; fsdp_guide.cli.build_parser(); "
        "print('deepspeed' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_catalog_has_every_stage_and_the_offload_variants() -> None:
    assert {STRATEGIES[n].zero_stage for n in DEEPSPEED} == {1, 2, 3}
    assert {n: STRATEGIES[n].offload for n in DEEPSPEED if STRATEGIES[n].offload} == {
        "deepspeed_zero2_offload": ("optimizer",),
        "deepspeed_zero3_offload": ("optimizer", "params"),
    }
    assert all(STRATEGIES[n].needs == {"deepspeed"} for n in DEEPSPEED)


@pytest.fixture
def no_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed looks uninstalled; launching anything fails the test."""
    monkeypatch.setattr(preflight_module, "deepspeed_installed", lambda: False)

    def no_launch(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a process was started")

    monkeypatch.setattr("fsdp_guide.compare._runs.launch", no_launch)


@pytest.mark.usefixtures("no_deepspeed")
@pytest.mark.parametrize("name", DEEPSPEED)
def test_a_missing_extra_is_one_line_naming_the_fix(name: str) -> None:
    with pytest.raises(MissingRequirementError) as info:
        check_strategies(["ddp", name])
    message = str(info.value)
    assert "\n" not in message and f"strategy {name!r} needs the optional extra" in message
    assert 'pip install -c requirements/constraints.txt -e ".[deepspeed]"' in message
    # Planning needs no DeepSpeed.
    assert [s.name for s in check_strategies([name], installed=False)] == [name]


@pytest.mark.usefixtures("no_deepspeed")
def test_compare_refuses_before_any_rank_starts(capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_guide.compare import run_comparison

    with pytest.raises(MissingRequirementError, match=r"-e \"\.\[deepspeed\]\""):
        run_comparison(["deepspeed_zero3"], progress=None)
    assert main(["compare", "--strategies", "deepspeed_zero1,deepspeed_zero2"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and 'pip install -c requirements/constraints.txt -e ".[deepspeed]"' in err
    )
    assert main(["estimate", "--params", "1e9"]) == 0  # the formulas do not need it


@pytest.mark.parametrize("bad", ["deepspeed_zero4", "deepspeed", "deepspeed_zero1_offload"])
def test_unknown_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match=f"unknown strategy {bad!r}"):
        check_strategies([bad])


def test_the_configs_compile_nothing_and_a_compiled_adam_needs_a_compiler(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for stage in (1, 2, 3):
        assert compiled_ops(zero_config(stage, offload_optimizer=True)) == []
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    preflight(zero_config(3, offload_optimizer=True, offload_params=True))  # nothing to build
    ds_adam = {"optimizer": {"type": "Adam"}, "zero_optimization": {"offload_optimizer": {}}}
    ds_adam["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    with pytest.raises(MissingRequirementError, match="compiles cpu_adam with a C"):
        preflight(ds_adam)


def test_the_adamw_trap_is_closed() -> None:
    params = zero_config(2)["optimizer"]["params"]
    assert params["torch_adam"] is True and params["adam_w_mode"] is False


@pytest.fixture(scope="module")
def without_compiler(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every DeepSpeed strategy, STEPS steps at 2 ranks, with no compiler on PATH."""
    root = tmp_path_factory.mktemp("no-compiler")
    # A PATH with ninja (which a JIT build calls first) and no compiler; python is run by its
    # absolute path. Without the shm_comm op turned off, init fails here: "c++: not found".
    (root / "bin").mkdir()
    ninja = shutil.which("ninja") or str(Path(sys.executable).with_name("ninja"))
    if Path(ninja).exists():
        (root / "bin" / "ninja").symlink_to(ninja)
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(TESTS)!r})
        from deepspeed_targets import losses_per_strategy
        from fsdp_guide import launch
        out = launch(losses_per_strategy, 2, args=({DEEPSPEED!r}, {STEPS}), backend="gloo",
                     start_method="fork", timeout=240)
        print("RESULT" + json.dumps(out[0]))
        """
    )
    env = {
        **os.environ,
        "PATH": str(root / "bin"),
        "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions"),  # nothing cached to reuse
    }
    env.pop("CXX", None)
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT") :])
    result["extensions_built"] = (
        sorted(p.name for p in (root / "torch_extensions").rglob("*.so"))
        if (root / "torch_extensions").exists()
        else []
    )
    return result


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nothing_was_compiled_and_no_compiler_was_there(without_compiler: dict[str, Any]) -> None:
    assert without_compiler["compiler"] is None
    assert without_compiler["extensions_built"] == []
    assert without_compiler["loaded_extensions"] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", DEEPSPEED)
def test_losses_equal_single_process_adam(without_compiler: dict[str, Any], name: str) -> None:
    assert without_compiler[name] == pytest.approx(adam_losses(), rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"])
def test_checkpoint_round_trip_and_consolidation(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from deepspeed_targets import checkpoint_round_trip

    from fsdp_guide.checkpoint import consolidate, load

    results = launch(
        checkpoint_round_trip,
        2,
        args=(name, str(tmp_path)),
        backend="gloo",
        start_method="fork",
        timeout=180,
    )
    for result in results:
        assert result["detected"] == "deepspeed"
        assert result["bit_equal"] and result["tensors"] > 0
        assert result["resumed"] == result["uninterrupted"]  # exactly
        assert result["extra"] == {"step": 2}
    capsys.readouterr()
    summary = consolidate(tmp_path / "ckpt", tmp_path / "full.pt")
    # DeepSpeed's own narration of the conversion (prints, progress bars) is not ours to show.
    assert capsys.readouterr() == ("", "")
    assert (summary["strategy"], summary["world_size"], summary["optimizer"]) == (
        "deepspeed",
        2,
        False,
    )
    plain = build_model("transformer")
    load(tmp_path / "full.pt", plain)
    weights = results[0]["weights"]
    assert weights.keys() == dict(plain.named_parameters()).keys()
    for key, value in plain.named_parameters():
        assert value.dtype == torch.float32 and torch.equal(value, weights[key]), key


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_write_failing_on_one_rank_raises_everywhere_and_keeps_the_previous(
    tmp_path: Path,
) -> None:
    from deepspeed_targets import failed_save_keeps_the_previous

    results = launch(
        failed_save_keeps_the_previous,
        2,
        args=(str(tmp_path),),
        backend="gloo",
        start_method="fork",
        timeout=180,
    )
    for result in results:
        assert result["error"] == "rank 1: OSError: [Errno 28] No space left on device"
        assert result["first_kept"]
        assert len(result["data_dirs"]) == 1  # the failed attempt's directory is gone


def test_an_engine_saves_only_sharded_and_consolidated_files_load_elsewhere() -> None:
    from fsdp_guide.checkpoint._api import _check_save_arguments

    with pytest.raises(ValueError, match="a DeepSpeed engine saves kind='sharded'"):
        _check_save_arguments(Path("x.pt"), "full", "deepspeed", None)


@pytest.mark.slow
def test_preparing_deepspeed_in_a_kernel_leaves_no_compiler_noise_in_the_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # DeepSpeed's op probes compile test programs; in a notebook the linker's complaints
    # (a missing libaio here) reached the cell's output.
    # ipykernel relays file descriptor 2 into the cells only outside pytest, as Jupyter does.
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from fsdp_guide.deepspeed._engine import import_deepspeed\n"
            "import_deepspeed().ops.__compatible_ops__['deepspeed_shm_comm']"
        ),
        # The kernel relays what reaches file descriptor 2 a moment later, into the cell
        # running then: give it one.
        nbformat.v4.new_code_cell("import time; time.sleep(1)"),
    ]
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    streams = [o for cell in nb.cells for o in cell.outputs if o.output_type == "stream"]
    assert streams == []
    assert nb.cells[0].outputs[-1]["data"]["text/plain"] == "False"


_GLOO_RANK_ON_A_GPU_MACHINE = """
import os, torch
torch.cuda.is_available = lambda: True  # a machine with one GPU ...
torch.cuda.device_count = lambda: 1
os.environ.pop("DS_ACCELERATOR", None)
from fsdp_guide.launcher import dist_init, find_free_port
from fsdp_guide.deepspeed import import_deepspeed
dist_init(0, 1, backend="gloo", master_port=find_free_port())  # ... whose ranks run on gloo
deepspeed = import_deepspeed()
print("accelerator:", deepspeed.get_accelerator().device_name())
"""


def test_a_gloo_rank_uses_the_cpu_accelerator_where_a_gpu_is_visible() -> None:
    # With one GPU the lessons run 2 CPU ranks under gloo; DeepSpeed's own probe would pick
    # CUDA there (it sees a GPU), and the engine would not match the rank's tensors.
    done = subprocess.run(
        [sys.executable, "-c", _GLOO_RANK_ON_A_GPU_MACHINE],
        capture_output=True,
        text=True,
        timeout=240,
        env={k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "accelerator: cpu" in done.stdout


@pytest.mark.parametrize(
    ("imported_as", "user_choice", "wanted", "refused"),
    [
        ("cuda", None, "cpu", True),  # the parent imported DeepSpeed on CUDA, the rank is gloo
        ("cpu", None, "cuda", True),
        ("cpu", None, "cpu", False),
        ("cuda", "cuda", "cpu", False),  # DS_ACCELERATOR set by the user: their choice
        ("cuda", None, None, False),  # no process group and a GPU: nothing to compare with
    ],
)
def test_deepspeed_imported_with_another_accelerator_is_refused(
    monkeypatch: pytest.MonkeyPatch,
    imported_as: str,
    user_choice: str | None,
    wanted: str | None,
    refused: bool,
) -> None:
    from types import SimpleNamespace

    from fsdp_guide.deepspeed._engine import _check_accelerator

    accelerator = SimpleNamespace(device_name=lambda: imported_as)
    fake = SimpleNamespace(get_accelerator=lambda: accelerator)
    if user_choice is None:
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    else:
        monkeypatch.setenv("DS_ACCELERATOR", user_choice)
    if refused:
        with pytest.raises(RuntimeError, match=f"Set DS_ACCELERATOR={wanted} before"):
            _check_accelerator(fake, wanted)  # type: ignore[arg-type]
    else:
        _check_accelerator(fake, wanted)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("group", "rank_type", "cuda", "expected"),
    [
        (True, "cpu", True, "cpu"),  # a gloo rank on a GPU machine
        (True, "cuda", True, "cuda"),  # an NCCL rank
        (False, None, False, "cpu"),
        (False, None, True, None),  # let DeepSpeed probe
    ],
)
def test_rank_accelerator_follows_the_rank_device(
    monkeypatch: pytest.MonkeyPatch,
    group: bool,
    rank_type: str | None,
    cuda: bool,
    expected: str | None,
) -> None:
    import torch.distributed as dist

    import fsdp_guide.launcher
    from fsdp_guide.deepspeed import rank_accelerator

    monkeypatch.setattr(dist, "is_initialized", lambda: group)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if rank_type is not None:
        monkeypatch.setattr(fsdp_guide.launcher, "rank_device", lambda: torch.device(rank_type))
    assert rank_accelerator() == expected
