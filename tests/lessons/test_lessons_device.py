"""Every lesson's training function computes on the device it is given, or on rank_device().

On a GPU workstation the launcher picks NCCL, so a lesson that builds its batch or its model
on the CPU breaks there (a device mismatch) although it runs on a CPU-only machine. This
test finds the mistake without a GPU: it runs each training function with a device that is
not the CPU (``meta``) and checks where the model's parameters and the batch are when the
function first computes a loss. The wrappers (DDP, OSS, ShardedDDP, FSDP, DeepSpeed) are
replaced by stand-ins that only record what they receive, and the loss function stops the
run, so nothing needs a process group. A function that ignores its device, or a cell that
builds a tensor on the CPU, leaves something on the CPU and fails.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from fsdp_guide.launcher import RankPlan

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
META = torch.device("meta")


class ReachedLoss(Exception):
    """Raised by the stand-in loss function: the run got as far as its first loss."""


@functools.cache
def _python_cells(notebook: str) -> tuple[ast.Module, ...]:
    """The notebook's code cells, parsed; cell magics and shell lines are left out."""
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    sources = ("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
    return tuple(ast.parse(s) for s in sources if not s.lstrip().startswith(("%", "!")))


def _definitions(notebook: str) -> list[tuple[ast.Module, bool]]:
    """The notebook's imports, functions, classes and UPPER_CASE constants, one by one.

    Each statement comes with whether it is a constant. Everything else (launches, prints,
    plots) is left out, so executing them is cheap and starts no process.
    """
    kept: list[tuple[ast.Module, bool]] = []
    for cell in _python_cells(notebook):
        for node in cell.body:
            constant = isinstance(node, ast.Assign) and all(
                isinstance(target, ast.Name | ast.Tuple)
                and all(n.id.isupper() for n in ast.walk(target) if isinstance(n, ast.Name))
                for target in node.targets
            )
            if constant or isinstance(
                node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.ClassDef
            ):
                kept.append((ast.Module(body=[node], type_ignores=[]), constant))
    return kept


class Recorder:
    """Devices of every parameter and batch tensor the stand-ins saw."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, torch.device]] = []
        self.losses = 0

    def params(self, where: str, params: Any) -> None:
        for p in params:
            self.seen.append((f"{where}: parameter {tuple(p.shape)}", p.device))

    def off_device(self, device: torch.device) -> list[str]:
        return [f"{what} on {dev}" for what, dev in self.seen if dev != device]


def _stand_ins(recorder: Recorder) -> dict[str, Any]:
    """Wrappers that record their inputs' devices and change nothing."""

    class Wrapper(nn.Module):
        def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
            super().__init__()
            recorder.params(type(self).__name__, module.parameters())
            self.module = module

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.module(*args, **kwargs)

        def no_sync(self) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

        def register_comm_hook(self, *args: Any) -> None:
            pass

        def refresh_trainable(self) -> None:
            pass

    class DDPStandIn(Wrapper):
        pass

    class ShardedDDPStandIn(Wrapper):
        pass

    class EngineStandIn(Wrapper):
        pass

    def optimizer(name: str) -> Callable[..., torch.optim.Optimizer]:
        def build(params: Any, optim: Any = None, optimizer_class: Any = None, **kw: Any) -> Any:
            params = list(params)
            recorder.params(name, params)
            return torch.optim.SGD(params, lr=kw.get("lr", 0.1))

        return build

    def shard(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        recorder.params("shard", module.parameters())
        return module

    def wrap(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        recorder.params("wrap", module.parameters())
        return module

    def initialize(model: nn.Module, config: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
        engine = EngineStandIn(model)
        return engine, torch.optim.SGD(engine.parameters(), lr=0.1)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        recorder.params("loss_fn", model.parameters())
        recorder.seen += [("inputs", batch[0].device), ("targets", batch[1].device)]
        recorder.losses += 1
        raise ReachedLoss

    return {
        "DDP": DDPStandIn,
        "DistributedDataParallel": DDPStandIn,
        "ShardedDataParallel": ShardedDDPStandIn,
        "OSS": optimizer("OSS"),
        "ZeroRedundancyOptimizer": optimizer("ZeroRedundancyOptimizer"),
        "shard": shard,
        "wrap": wrap,
        "wrapping": lambda **kwargs: contextlib.nullcontext(),
        "initialize": initialize,
        "check_optimizer": lambda *args, **kwargs: None,
        # fsdp_guide.timeline.record_units: runs the step it is given
        "record_units": lambda model, forward, backward: backward(forward()),
        "loss_fn": loss_fn,
    }


# (notebook, training function, its arguments after rank and world_size). Every function
# that a lesson launches to train or to measure a model is here; test_every_launched_
# function_is_listed fails when a lesson gains one that is not.
CASES: list[tuple[str, str, tuple[Any, ...]]] = [
    ("01_launching_multi_process_cells.ipynb", "train", (1,)),
    ("01_launching_multi_process_cells.ipynb", "train_digits", (1, 32)),
    # the single-process reference, on the batches one rank saw (indices 0-63)
    (
        "01_launching_multi_process_cells.ipynb",
        "train_digits_in_one_process",
        ([{"seen": [list(range(64))]}], 1, 32),
    ),
    ("02_optimizer_state_sharding.ipynb", "train", ("ddp",)),
    ("02_optimizer_state_sharding.ipynb", "train", ("oss",)),
    ("02_optimizer_state_sharding.ipynb", "train", ("zero1",)),
    ("02_optimizer_state_sharding.ipynb", "optimizer_bytes", ()),
    ("02_optimizer_state_sharding.ipynb", "save_oss", ("/nonexistent",)),
    ("03_sharded_ddp.ipynb", "train", ("ddp",)),
    ("03_sharded_ddp.ipynb", "train", ("oss",)),
    ("03_sharded_ddp.ipynb", "train", ("sdp",)),
    ("03_sharded_ddp.ipynb", "train_with", ()),
    ("03_sharded_ddp.ipynb", "ddp_norms", ()),
    ("04_fully_sharded_data_parallel.ipynb", "train", ("fsdp1", 2, {})),
    ("04_fully_sharded_data_parallel.ipynb", "train", ("fsdp2", 2, {})),
    ("04_fully_sharded_data_parallel.ipynb", "train_fairscale", (2,)),
    ("04_fully_sharded_data_parallel.ipynb", "optimizer_too_early", ()),
    ("04_fully_sharded_data_parallel.ipynb", "record_one_step", ()),
    ("05_wrapping_policies.ipynb", "train_policies", ({"blocks": None},)),
    ("05_wrapping_policies.ipynb", "wrap_fsdp2", (None,)),
    ("05_wrapping_policies.ipynb", "train_manual", ("fsdp1",)),
    ("06_activation_checkpointing.ipynb", "train", (2,)),
    ("08_ddp_optimizations.ipynb", "train", ()),
    ("08_ddp_optimizations.ipynb", "train", ({}, None, 3, 1, 256)),
    ("08_ddp_optimizations.ipynb", "accumulate_every_step", ()),
    ("09_deepspeed_zero.ipynb", "train", ({},)),
    ("09_deepspeed_zero.ipynb", "train_and_save", ()),
    ("10_lightning_fsdp_strategies.ipynb", "train_plain", ({},)),
    ("12_sharded_checkpoints.ipynb", "save_both", ("fsdp2",)),
    ("12_sharded_checkpoints.ipynb", "deepspeed_save", ()),
    ("12_sharded_checkpoints.ipynb", "crash_second_save", ("dcp.save",)),
    ("12_sharded_checkpoints.ipynb", "save_step_3", (False,)),
    ("13_one_step_in_time.ipynb", "one_step", ("ddp",)),
    ("13_one_step_in_time.ipynb", "one_step", ("zero1",)),
    ("13_one_step_in_time.ipynb", "one_step", ("fsdp2", {"reshard_after_forward": False})),
    ("13_one_step_in_time.ipynb", "one_step", ("deepspeed_zero3",)),
    ("13_one_step_in_time.ipynb", "every_step", ({"FSDP1": ("fsdp1", {})},)),
    ("15_fsdp2_in_practice.ipynb", "accumulate_all", ()),
    ("15_fsdp2_in_practice.ipynb", "clip_norms", ()),
    ("15_fsdp2_in_practice.ipynb", "frozen_runs", ()),
    ("15_fsdp2_in_practice.ipynb", "mixed_both", ()),
    ("15_fsdp2_in_practice.ipynb", "compiled_all", ()),
    ("15_fsdp2_in_practice.ipynb", "save_while_training", ("/nonexistent",)),
]


@contextlib.contextmanager
def _lesson(notebook: str, recorder: Recorder) -> Iterator[dict[str, Any]]:
    namespace: dict[str, Any] = {"__name__": f"lesson_{notebook[:2]}"}
    for statement, constant in _definitions(notebook):
        try:
            exec(compile(statement, notebook, "exec"), namespace)
        except NameError:
            if not constant:  # a constant computed from a variable: the functions need it not
                raise
    namespace.update(_stand_ins(recorder))
    yield namespace


def _run_to_first_loss(function: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    with pytest.raises(ReachedLoss):
        function(0, 2, *args, **kwargs)


@pytest.mark.parametrize(("notebook", "name", "args"), CASES, ids=lambda v: str(v)[:24])
def test_training_function_computes_on_the_device_it_is_given(
    notebook: str, name: str, args: tuple[Any, ...]
) -> None:
    recorder = Recorder()
    with _lesson(notebook, recorder) as namespace:
        _run_to_first_loss(namespace[name], *args, device=META)
    assert recorder.losses == 1
    assert any(what == "targets" for what, _ in recorder.seen)
    assert recorder.off_device(META) == []


@pytest.mark.parametrize(("notebook", "name", "args"), CASES, ids=lambda v: str(v)[:24])
def test_training_function_defaults_to_rank_device(
    notebook: str, name: str, args: tuple[Any, ...]
) -> None:
    function_device = inspect.signature(_lesson_function(notebook, name)).parameters.get("device")
    assert function_device is not None and function_device.default is None, (
        f"{notebook}: {name} needs a `device=None` parameter (None: rank_device())"
    )
    recorder = Recorder()
    with _lesson(notebook, recorder) as namespace:
        namespace["rank_device"] = lambda: META  # what the launcher would say under NCCL
        _run_to_first_loss(namespace[name], *args)
    assert recorder.off_device(META) == []


def _lesson_function(notebook: str, name: str) -> Callable[..., Any]:
    with _lesson(notebook, Recorder()) as namespace:
        function: Callable[..., Any] = namespace[name]
        return function


def _launched(notebook: str) -> set[str]:
    """Names of the functions a notebook passes to launch() (first argument)."""
    names: set[str] = set()
    for cell in _python_cells(notebook):
        for node in ast.walk(cell):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "launch"
                and node.args
                and isinstance(node.args[0], ast.Name)
            ):
                names.add(node.args[0].id)
    return names


# Launched functions that compute no loss (they inspect how a model is split, or fail on
# purpose), or that only call functions of CASES with their default device.
NO_TRAINING = {
    ("01_launching_multi_process_cells.ipynb", "flaky"),
    ("02_optimizer_state_sharding.ipynb", "owned_parameters"),
    ("02_optimizer_state_sharding.ipynb", "owned_elements"),
    ("02_optimizer_state_sharding.ipynb", "compare"),
    ("03_sharded_ddp.ipynb", "compare"),
    ("03_sharded_ddp.ipynb", "rules"),
    ("03_sharded_ddp.ipynb", "freeze_both_ways"),
    ("04_fully_sharded_data_parallel.ipynb", "fsdp2_layout"),
    ("04_fully_sharded_data_parallel.ipynb", "wrap_odd_model"),
    # exercise checks: what they launch is measured, not trained (or defined inside the
    # check, where they run only once the exercise is attempted)
    ("01_launching_multi_process_cells.ipynb", "real_collectives"),
    ("02_optimizer_state_sharding.ipynb", "sgd_momentum_bytes"),
    ("04_fully_sharded_data_parallel.ipynb", "record_without_reshard"),
    ("04_fully_sharded_data_parallel.ipynb", "gathered"),
    ("07_lightning_strategies.ipynb", "oss_state_bytes"),
    ("07_lightning_strategies.ipynb", "oss_layout"),
    ("05_wrapping_policies.ipynb", "wrap_fairscale"),
    ("08_ddp_optimizations.ipynb", "without_the_flag"),
    ("08_ddp_optimizations.ipynb", "_check_accumulate"),  # trains the reader's accumulate
    # Lightning places model and batches itself: these build a Trainer from PLAN (below).
    ("10_lightning_fsdp_strategies.ipynb", "fit"),
    ("10_lightning_fsdp_strategies.ipynb", "fails"),
    ("10_lightning_fsdp_strategies.ipynb", "wrapped_tree"),
    # Lesson 11 builds and loads models and measures the allocations; it computes no loss.
    ("11_building_and_loading_big_models.ipynb", "naive"),
    ("11_building_and_loading_big_models.ipynb", "meta_recipe"),
    ("11_building_and_loading_big_models.ipynb", "sharded_from_the_start"),
    ("11_building_and_loading_big_models.ipynb", "fsdp1_from_meta"),
    ("11_building_and_loading_big_models.ipynb", "zero_init"),
    ("11_building_and_loading_big_models.ipynb", "lightning_build"),
    ("11_building_and_loading_big_models.ipynb", "load"),
    # Lesson 12 restores checkpoints before training with make()/train_steps(), which
    # save_both (above) checks; save_then_crash writes a file and dies on purpose.
    ("12_sharded_checkpoints.ipynb", "resume"),
    ("12_sharded_checkpoints.ipynb", "load_after_crash"),
    ("12_sharded_checkpoints.ipynb", "save_then_crash"),
    # a package function (fsdp_guide.parallel), device=None meaning rank_device(), tested
    # on 4 ranks in tests/parallel
    ("14_beyond_data_parallelism.ipynb", "train_2d"),
    # Lesson 15 calls fully_shard itself to place a tied weight (the stand-ins replace shard),
    # and hangs a collective on purpose.
    ("15_fsdp2_in_practice.ipynb", "tied_all"),
    ("15_fsdp2_in_practice.ipynb", "skip_collective"),
    # package functions (fsdp_guide.parallel), device=None meaning rank_device(), tested on 2
    # and 4 ranks in tests/parallel; and checks that train nothing (attention on random
    # tensors, a router's routing)
    ("17_context_and_expert_parallelism.ipynb", "train_context_parallel"),
    ("17_context_and_expert_parallelism.ipynb", "train_expert_parallel"),
    ("17_context_and_expert_parallelism.ipynb", "ring_check"),
    ("17_context_and_expert_parallelism.ipynb", "ring_timeline"),
    ("17_context_and_expert_parallelism.ipynb", "route"),
    # a package function (fsdp_guide.parallel), device=None meaning rank_device(), tested on
    # 2 and 4 ranks in tests/parallel
    ("16_pipeline_parallelism.ipynb", "train_pipeline"),
}


def test_every_launched_function_is_listed() -> None:
    listed = {(notebook, name) for notebook, name, _ in CASES}
    for notebook in sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")):
        for name in _launched(notebook):
            assert (notebook, name) in listed | NO_TRAINING, (
                f"{notebook} launches {name}: add it to CASES (or NO_TRAINING)"
            )


class _TrainerSpy:
    """Stands in for ``pl.Trainer``: keeps the arguments a lesson builds it with."""

    calls: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, **kwargs: Any) -> None:
        type(self).calls.append(kwargs)


@pytest.mark.parametrize(
    "plan",
    [
        RankPlan(world_size=4, backend="nccl", gpus=4),
        RankPlan(world_size=2, backend="gloo", gpus=1),
    ],
    ids=str,
)
def test_lightning_lesson_trains_where_the_plan_says(plan: RankPlan) -> None:
    # Lightning moves the model and each batch to its accelerator's device itself; what
    # the lesson decides is the accelerator and the number of devices, from plan_ranks().
    notebook = "07_lightning_strategies.ipynb"
    with _lesson(notebook, Recorder()) as namespace:
        namespace["PLAN"], namespace["WORLD_SIZE"] = plan, plan.world_size
        namespace["pl"] = type(
            "pl", (), {"Trainer": _TrainerSpy, "seed_everything": lambda *a, **k: None}
        )
        _TrainerSpy.calls = []
        namespace["trainer"]("ddp_sharded_notebook")
    (options,) = _TrainerSpy.calls
    assert (options["accelerator"], options["devices"]) == (plan.accelerator, plan.world_size)


@pytest.mark.parametrize(
    "plan",
    [
        RankPlan(world_size=4, backend="nccl", gpus=4),
        RankPlan(world_size=2, backend="gloo", gpus=0),
    ],
    ids=str,
)
def test_lightning_fsdp_lesson_follows_the_plan(plan: RankPlan) -> None:
    # Lesson 10 builds each rank's Trainer with make_trainer, and picks Lightning's own
    # FSDPStrategy on GPUs, the CPU teaching aid on CPU ranks.
    notebook = "10_lightning_fsdp_strategies.ipynb"
    with _lesson(notebook, Recorder()) as namespace:
        namespace["PLAN"], namespace["WORLD_SIZE"] = plan, plan.world_size
        strategy = namespace["fsdp"]()
        namespace["pl"] = type("pl", (), {"Trainer": _TrainerSpy})
        _TrainerSpy.calls = []
        namespace["make_trainer"](strategy)
    (options,) = _TrainerSpy.calls
    assert (options["accelerator"], options["devices"]) == (plan.accelerator, plan.world_size)
    expected = "FSDPStrategy" if plan.backend == "nccl" else "CPUFSDPStrategy"
    assert type(strategy).__name__ == expected
