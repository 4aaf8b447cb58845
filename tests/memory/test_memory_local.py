"""Single-process tests: ModelState, measure_model_state on plain modules, estimates, sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_guide.memory import (
    ModelState,
    bytes_per_param,
    estimate_model_state,
    format_bytes,
    measure_model_state,
    parse_size,
    peak_memory,
)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    model(inputs).sum().backward()
    optimizer.step()


@pytest.mark.parametrize(
    ("make_optimizer", "optimizer_bytes_per_param", "per_tensor"),
    [
        (lambda ps: torch.optim.Adam(ps), 8, 4),
        (lambda ps: torch.optim.AdamW(ps), 8, 4),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 4, 0),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), 0, 0),
    ],
    ids=["adam", "adamw", "sgd_momentum", "sgd"],
)
def test_plain_module(make_optimizer, optimizer_bytes_per_param: int, per_tensor: int) -> None:
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))  # 35 + 12 = 47
    optimizer = make_optimizer(model.parameters())
    _step(model, optimizer, torch.randn(3, 6))
    state = measure_model_state(model, optimizer)
    assert state == ModelState(
        params=4 * 47, grads=4 * 47, optimizer=optimizer_bytes_per_param * 47 + per_tensor * 4
    )
    optimizer.zero_grad()
    assert measure_model_state(model, optimizer).grads == 0


def test_tied_weights_counted_once() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    model.emb.weight.grad = torch.ones(10, 4)
    assert measure_model_state(model) == ModelState(params=160, grads=160, optimizer=0)


def test_views_of_one_buffer_count_the_buffer_once() -> None:
    # What OSS and DDP's bucket views do: many tensors, one flat storage.
    flat = torch.zeros(30)
    model = nn.Linear(4, 4)  # 20 parameters, viewing a 30-element buffer
    model.weight.data = flat[:16].view(4, 4)
    model.bias.data = flat[16:20]
    assert measure_model_state(model).params == 30 * 4


def test_half_precision_bytes() -> None:
    model = nn.Linear(8, 8).half()
    assert measure_model_state(model).params == 72 * 2


@pytest.mark.parametrize(
    ("module", "optimizer", "match"),
    [
        ("not a module", None, "module must be a torch.nn.Module"),
        (nn.Linear(1, 1), "adam", "optimizer must be a torch.optim.Optimizer"),
    ],
)
def test_measure_rejects_bad_input(module: object, optimizer: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        measure_model_state(module, optimizer)  # type: ignore[arg-type]


@pytest.mark.parametrize(("stage", "gigabytes"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage: int, gigabytes: float) -> None:
    state = estimate_model_state(7.5e9, 64, stage, "mixed", "adam")
    assert round(state.total / 1e9, 1) == gigabytes


@pytest.mark.parametrize(
    ("precision", "optimizer", "per"),
    [
        ("fp32", "adam", (4, 4, 8)),
        ("fp32", "sgd_momentum", (4, 4, 4)),
        ("fp32", "sgd", (4, 4, 0)),
        ("mixed", "adam", (2, 2, 12)),
        ("mixed", "sgd_momentum", (2, 2, 8)),
        ("mixed", "sgd", (2, 2, 4)),
    ],
)
@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_stage_formulas(
    precision: str, optimizer: str, per: tuple[int, int, int], world_size: int
) -> None:
    p, g, k = per
    assert tuple(vars(bytes_per_param(precision, optimizer)).values()) == per  # type: ignore[arg-type]
    n = 24_000
    expected = {
        0: (p * n, g * n, k * n),
        1: (p * n, g * n, k * n // world_size),
        2: (p * n, g * n // world_size, k * n // world_size),
        3: (p * n // world_size, g * n // world_size, k * n // world_size),
    }
    for stage, want in expected.items():
        state = estimate_model_state(n, world_size, stage, precision, optimizer)  # type: ignore[arg-type]
        assert (state.params, state.grads, state.optimizer) == want


@pytest.mark.parametrize(
    ("name", "stage"),
    [("ddp", 0), ("zero1", 1), ("oss", 1), ("sharded_ddp", 2), ("fsdp", 3), ("fsdp2", 3)],
)
def test_stage_by_name(name: str, stage: int) -> None:
    assert estimate_model_state(1000, 4, name) == estimate_model_state(1000, 4, stage)


def test_full_grads_and_rounding_up() -> None:
    assert estimate_model_state(10, 4, 2, full_grads=True).grads == 40
    assert estimate_model_state(10, 4, 3).params == 10  # ceil(40 / 4)
    assert estimate_model_state(11, 4, 3).params == 11  # ceil(44 / 4)
    assert estimate_model_state(10, 3, 3).params == 14  # ceil(40 / 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_params": 0}, "num_params must be a positive"),
        ({"num_params": -5}, "num_params must be a positive"),
        ({"num_params": float("nan")}, "num_params must be a positive finite"),
        ({"num_params": float("inf")}, "num_params must be a positive finite"),
        ({"world_size": 0}, "world_size must be an int >= 1"),
        ({"world_size": 2.5}, "world_size must be an int >= 1"),
        ({"stage": 4}, "unknown stage 4"),
        ({"stage": "zero4"}, "unknown stage 'zero4'"),
        ({"precision": "bf16"}, "unknown precision 'bf16'"),
        ({"optimizer": "lamb"}, "unknown optimizer 'lamb'"),
    ],
)
def test_estimate_rejects_bad_input(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"num_params": 100, "world_size": 2, "stage": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        estimate_model_state(**args)  # type: ignore[arg-type]


def test_model_state_is_frozen_and_checked() -> None:
    state = ModelState(1, 2, 3)
    with pytest.raises(AttributeError):
        state.params = 5  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"ModelState\.grads must be an int >= 0"):
        ModelState(1, -2, 3)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("80GB", 80 * 10**9),
        ("80 GiB", 80 * 2**30),
        ("1.5T", 1_500_000_000_000),
        ("8e10", 8 * 10**10),
        ("512MB", 512 * 10**6),
        ("64", 64),
        ("2kib", 2048),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GB", "eighty", "80XB", "-3GB", "1 iB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"as a size; write e\.g\. 80GB"):
        parse_size(text)


def test_parse_size_rejects_overflow() -> None:
    with pytest.raises(ValueError, match=r"size '1e400' is too large; write e\.g\. 80GB"):
        parse_size("1e400")


def test_format_bytes_units() -> None:
    assert format_bytes(999) == "999 B"
    assert format_bytes(13_807_616) == "13.81 MB"
    with pytest.raises(ValueError, match="unknown unit"):
        format_bytes(1, "PB")


def test_peak_memory_on_cpu_is_labelled_as_rss() -> None:
    import psutil

    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    peak = peak_memory("cpu")
    current = psutil.Process().memory_info().rss
    assert peak.kind == "cpu_peak_rss"
    assert "not model state" in peak.label
    # In bytes (Linux reports KiB): about what is resident now or more, not 1000x off.
    # (The kernel updates its high-water mark lazily, hence the slack.)
    assert 0.9 * current <= peak.bytes < 100 * current
    del big


@pytest.mark.gpu
def test_peak_memory_on_cuda() -> None:
    torch.cuda.reset_peak_memory_stats()
    x = torch.empty(2**20, device="cuda")  # 4 MiB
    peak = peak_memory("cuda")
    assert peak.kind == "cuda_peak_allocated"
    assert peak.bytes >= x.numel() * 4
