"""shard(), wrapping()/wrap() and check_optimizer(): errors, and behaviour on a 1-rank group.

The 1-rank gloo group lives in the test process (fast); the 2-rank runs are in
test_wrap_sharded.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_guide import find_free_port
from fsdp_guide.errors import EngineUnavailableError, OptimizerMismatchError
from fsdp_guide.launcher import dist_init, rank_device
from fsdp_guide.models import Block, TinyTransformer, TransformerConfig, count_params
from fsdp_guide.wrap import (
    LayerPolicy,
    SizePolicy,
    WrapPolicy,
    check_optimizer,
    describe,
    shard,
    sharded_units,
    wrap,
    wrapping,
)

CONFIG = TransformerConfig(vocab_size=64, dim=32, n_heads=2, n_layers=2, seq_len=16)
CPU_ENGINES = ["fsdp1", "fsdp2"]


def build() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(CONFIG)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist_init(0, 1, backend="gloo", master_port=find_free_port())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


FAIRSCALE_ON_CPU = r"needs CUDA.*use engine='fsdp1' \(PyTorch FSDP1\) or engine='fsdp2'"


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize("module", [build(), "not a module", None])
def test_fairscale_without_cuda_is_refused_first(module: Any) -> None:
    # Even with a bad module and no process group, the engine error comes first.
    with pytest.raises(EngineUnavailableError, match=FAIRSCALE_ON_CPU):
        shard(module, engine="fairscale_fsdp", policy=LayerPolicy(Block))


@pytest.mark.usefixtures("no_cuda")
def test_fairscale_wrapping_without_cuda_is_refused() -> None:
    with pytest.raises(EngineUnavailableError, match=FAIRSCALE_ON_CPU), wrapping("fairscale_fsdp"):
        pass


@pytest.fixture
def gpu_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this CPU machine has a GPU: what every engine sees on a GPU machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.mark.usefixtures("one_rank_group", "gpu_visible")
@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_a_gloo_run_stays_on_cpu_with_a_gpu_visible(engine: str) -> None:
    # FSDP1 used to take the current GPU whenever CUDA existed, FSDP2 the backend's device.
    assert rank_device() == torch.device("cpu")
    sharded = shard(build(), engine=engine, policy=LayerPolicy(Block))  # type: ignore[arg-type]
    devices = {p.device for p in sharded.parameters()}
    assert devices == {torch.device("cpu")}, devices
    if engine == "fsdp1":
        assert sharded.compute_device == torch.device("cpu")  # type: ignore[comparison-overlap]


@pytest.mark.usefixtures("one_rank_group", "gpu_visible")
def test_fairscale_in_a_gloo_group_is_refused() -> None:
    with pytest.raises(EngineUnavailableError, match=r"needs the NCCL backend"):
        shard(build(), engine="fairscale_fsdp")
    with (
        pytest.raises(EngineUnavailableError, match=r"needs the NCCL backend"),
        wrapping("fairscale_fsdp"),
    ):
        pass


@pytest.mark.usefixtures("one_rank_group", "gpu_visible")
@pytest.mark.parametrize(
    ("backend", "local_rank", "expected"),
    [
        ("nccl", "3", torch.device("cuda", 3)),
        ("cpu:gloo,cuda:nccl", "1", torch.device("cuda", 1)),
        ("nccl", None, torch.device("cuda", 0)),  # dist_init: the current GPU
        ("gloo", "1", torch.device("cpu")),
    ],
)
def test_rank_device_follows_the_backend(
    monkeypatch: pytest.MonkeyPatch, backend: str, local_rank: str | None, expected: torch.device
) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert rank_device() == expected


def test_rank_device_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match=r"rank_device\(\) needs a torch.distributed"):
        rank_device()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"engine": "ddp"}, ValueError, "unknown engine 'ddp'; choose one of 'fsdp1', 'fsdp2'"),
        ({"engine": "fsdp1", "module": nn.Linear}, TypeError, "takes an nn.Module, got type"),
        ({"engine": "fsdp2", "policy": Block}, TypeError, "policy must be a WrapPolicy such as"),
        (
            {"engine": "fsdp1", "auto_wrap_policy": LayerPolicy(Block).for_torch()},
            ValueError,
            r"pass the wrap policy as policy=SizePolicy\(...\) / LayerPolicy",
        ),
        ({"engine": "fsdp2"}, RuntimeError, r"inside a function run by fsdp_guide.launch"),
        ({"engine": "fsdp1"}, RuntimeError, r"needs a torch.distributed process group"),
    ],
)
def test_bad_shard_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    kwargs = {"module": build(), **kwargs}
    with pytest.raises(error, match=match):
        shard(**kwargs)


def test_wrapping_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match=r"wrapping\(\) needs a torch.distributed"), wrapping():
        pass


def test_wrap_outside_a_block_returns_the_module_unchanged() -> None:
    model = build()
    before = {name: p for name, p in model.named_parameters()}
    assert wrap(model.blocks[0]) is model.blocks[0]
    assert wrap(model) is model
    assert dict(model.named_parameters()) == before
    assert not sharded_units(model)


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_manual_wrap_inside_block_and_no_op_after(engine: str) -> None:
    model = build()
    with wrapping(engine=engine):  # type: ignore[arg-type]
        model.blocks[0] = wrap(model.blocks[0])
        model = wrap(model)
    after = wrap(model.head)
    assert after is model.head or after is getattr(model, "module", model).head
    units = sharded_units(model)
    assert set(units) == {"", "blocks.0"}
    assert {kind for kind, _ in units.values()} == {engine}
    assert units["blocks.0"][1] == count_params(build().blocks[0])
    assert sum(n for _, n in units.values()) == count_params(build())
    assert "0: Block  [unit: " + engine in describe(model)


@pytest.mark.usefixtures("one_rank_group")
def test_the_default_engine_is_fsdp2_the_one_pytorch_maintains() -> None:
    # FSDP1 and FairScale are taught for existing code; what a call without an engine builds
    # is what new code should use.
    model = shard(build(), policy=LayerPolicy(Block))
    assert {engine for engine, _ in sharded_units(model).values()} == {"fsdp2"}
    with wrapping():
        manual = wrap(build())
    assert {engine for engine, _ in sharded_units(manual).values()} == {"fsdp2"}


@pytest.mark.usefixtures("one_rank_group")
def test_wrapping_blocks_do_not_nest() -> None:
    with (
        wrapping(engine="fsdp2"),
        pytest.raises(RuntimeError, match="do not nest"),
        wrapping(engine="fsdp2"),
    ):
        pass


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_policy_on_a_model_wrapped_by_hand_is_refused(engine: str) -> None:
    model = build()
    with wrapping(engine=engine):  # type: ignore[arg-type]
        model.blocks[0] = wrap(model.blocks[0])
    with pytest.raises(ValueError, match=r"already has FSDP units.*Pass policy=None"):
        shard(model, engine=engine, policy=LayerPolicy(Block))  # type: ignore[arg-type]
    root = shard(model, engine=engine)  # type: ignore[arg-type]
    assert set(sharded_units(root)) == {"", "blocks.0"}


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_optimizer_built_before_wrapping_is_caught(engine: str) -> None:
    model = build()
    early = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the classic mistake
    sharded = shard(model, engine=engine, policy=LayerPolicy(Block))  # type: ignore[arg-type]
    with pytest.raises(OptimizerMismatchError, match=r"built from the unwrapped model.*Build the"):
        check_optimizer(sharded, early)
    check_optimizer(sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-3))


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("engine", ["fsdp2"])
def test_stepping_an_optimizer_built_before_shard_fails_with_the_fix(engine: str) -> None:
    # The notebook case: fsdp2 shards in place, so `model = shard(model)` looks harmless.
    t0 = time.monotonic()
    model = build()
    early = torch.optim.Adam(model.parameters(), lr=1e-2)
    model = shard(model, engine=engine)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
    model(tokens).float().pow(2).mean().backward()
    with pytest.raises(
        OptimizerMismatchError,
        match=rf"built before shard\(\.\.\., engine='{engine}'\).*Build the optimizer after",
    ):
        early.step()
    late = torch.optim.Adam(model.parameters(), lr=1e-2)
    late.step()  # built afterwards: steps normally
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("one_rank_group")
def test_fsdp1_leaves_the_early_optimizer_to_check_optimizer() -> None:
    # Lesson 04 trains with it to show the flat loss, then check_optimizer names the fix.
    model = build()
    early = torch.optim.Adam(model.parameters(), lr=1e-2)
    model = shard(model, engine="fsdp1")
    early.step()
    with pytest.raises(OptimizerMismatchError, match="built from the unwrapped model"):
        check_optimizer(model, early)


def test_optimizer_with_no_parameters_is_caught() -> None:
    model = build()
    empty = torch.optim.SGD([{"params": []}], lr=0.1)
    with pytest.raises(OptimizerMismatchError, match=r"holds no parameters.*Build the optimizer"):
        check_optimizer(model, empty)


def test_optimizer_missing_parameters_is_caught() -> None:
    model = build()
    partial = torch.optim.SGD(model.blocks.parameters(), lr=0.1)
    with pytest.raises(
        OptimizerMismatchError,
        match=r"5 trainable parameter\(s\).*\(tok_emb.weight, pos_emb.weight, ln_f.weight, ",
    ):
        check_optimizer(model, partial)
    model.tok_emb.requires_grad_(False)
    model.pos_emb.requires_grad_(False)
    model.ln_f.requires_grad_(False)
    model.head.requires_grad_(False)
    check_optimizer(model, partial)  # frozen parameters need no optimizer


def test_partial_optimizers_and_a_custom_fix() -> None:
    model = build()
    blocks = torch.optim.SGD(model.blocks.parameters(), lr=0.1)  # one of several optimizers
    check_optimizer(model, blocks, partial=True)
    stale = torch.optim.SGD([*model.blocks.parameters(), torch.zeros(3)], lr=0.1)
    with pytest.raises(OptimizerMismatchError, match=r"1 tensor\(s\) \(3 elements\).*\. Do X$"):
        check_optimizer(model, stale, partial=True, fix="Do X")


@pytest.mark.parametrize(
    ("model", "optimizer", "match"),
    [
        ("model", torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), "model must be"),
        (nn.Linear(1, 1), "adam", "optimizer must be a torch.optim.Optimizer"),
    ],
)
def test_check_optimizer_types(model: Any, optimizer: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        check_optimizer(model, optimizer)


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize(
    "policy",
    [LayerPolicy(Block), SizePolicy(2_000), LayerPolicy(nn.Embedding) | SizePolicy(10_000)],
)
def test_describe_reads_fairscale_units(policy: WrapPolicy) -> None:
    """FairScale's FSDP can be built (not run) on CPU: enough to check what describe reads."""
    from fairscale.nn import FullyShardedDataParallel
    from fairscale.nn.wrap import auto_wrap, enable_wrap

    cpu = torch.device("cpu")
    with enable_wrap(
        wrapper_cls=FullyShardedDataParallel,
        auto_wrap_policy=policy.for_fairscale(),
        compute_device=cpu,
    ):
        inner = auto_wrap(build())
    model = FullyShardedDataParallel(inner, compute_device=cpu)
    units = sharded_units(model)
    planned = sharded_units(build(), policy=policy)
    assert {name: n for name, (_, n) in units.items()} == {
        name: n for name, (_, n) in planned.items()
    }
    assert {kind for kind, _ in units.values()} == {"fairscale_fsdp"}
    assert describe(model).count("[unit: fairscale_fsdp,") == len(planned)


@pytest.mark.parametrize(("old", "new"), [("torch", "fsdp1"), ("fairscale", "fairscale_fsdp")])
def test_engines_are_named_as_in_the_catalog_and_old_names_still_work(old: str, new: str) -> None:
    from fsdp_guide.catalog import STRATEGIES
    from fsdp_guide.engines import UNIT_ENGINES, unit_engine

    assert {e.name for e in UNIT_ENGINES} <= {spec.engine for spec in STRATEGIES.values()}
    if new == "fairscale_fsdp":
        with pytest.raises(EngineUnavailableError, match="engine 'fairscale_fsdp'"):
            unit_engine(old)
    else:
        assert unit_engine(old).name == new


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize(
    ("counts", "forward", "backward"),
    [
        # Block i gathers the next blocks in forward and, nearest first, the earlier ones in
        # backward; the last blocks prefetch what is left, 0 leaves FSDP2's own order.
        ({"forward_prefetch": 2}, [[1, 2], [2], []], [[], [], []]),
        ({"backward_prefetch": 2}, [[], [], []], [[], [0], [1, 0]]),
        ({"forward_prefetch": 1, "backward_prefetch": 5}, [[1], [2], []], [[], [0], [1, 0]]),
    ],
)
def test_fsdp2_prefetch_counts_become_each_blocks_prefetch_list(
    counts: dict[str, int], forward: list[list[int]], backward: list[list[int]]
) -> None:
    torch.manual_seed(0)
    model = shard(
        TinyTransformer(TransformerConfig(vocab_size=64, dim=32, n_heads=2, n_layers=3)),
        engine="fsdp2",
        policy=LayerPolicy(Block),
        **counts,
    )
    states = [block._get_fsdp_state() for block in model.blocks]
    # FSDPModule.set_modules_to_*_prefetch record the targets' states only there.
    assert [[states.index(s) for s in st._states_to_forward_prefetch] for st in states] == forward
    assert [[states.index(s) for s in st._states_to_backward_prefetch] for st in states] == backward


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"], ids=repr)
@pytest.mark.parametrize("name", ["forward_prefetch", "backward_prefetch"])
def test_a_bad_fsdp2_prefetch_count_is_refused_before_sharding(name: str, bad: Any) -> None:
    model = build()
    with pytest.raises(ValueError, match=rf"FSDP2's {name} is how many blocks .* give an int >= 0"):
        shard(model, engine="fsdp2", policy=LayerPolicy(Block), **{name: bad})
    assert sharded_units(model) == {}  # nothing was sharded
