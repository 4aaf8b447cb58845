"""What an example batch is made of: inputs stated as ``name:dtype[dims]`` (``InputSpec``,
``parse_input``) and the batch built for a model (``ExampleBatch``) (private).

:func:`fsdp_guide.inputs.example_batch` reads a model and returns an ``ExampleBatch``; the
command line's ``--input`` states inputs in this text form.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fsdp_guide.errors import PlanError

#: Builds ``(inputs, targets)`` for ``(batch_size, seq_len)``.
BatchBuilder = Callable[[int, int], tuple[Any, Tensor | None]]

_DTYPES = {
    name: getattr(torch, name)
    for name in (
        *("int64", "int32", "int16", "int8", "uint8", "bool"),
        *("float32", "float16", "bfloat16", "float64"),
    )
}
_SPEC_RE = re.compile(r"^\s*([A-Za-z_]\w*)\s*:\s*(\w+)\s*\[([^\]]*)\]\s*$")


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """One input of a model: its keyword, dtype and dimensions.

    Attributes:
        name: The keyword of ``forward`` it is passed as.
        dtype: A torch dtype name (``"int64"``, ``"float32"``, ...).
        dims: Each dimension: an integer, ``"B"`` (batch size) or ``"S"`` (sequence length).
    """

    name: str
    dtype: str
    dims: tuple[int | str, ...]

    def shape(self, batch_size: int, seq_len: int) -> tuple[int, ...]:
        """The dimensions with ``B`` and ``S`` bound.

        Examples:
            >>> parse_input("input_ids:int64[B,S]").shape(4, 128)
            (4, 128)
        """
        sizes = {"B": batch_size, "S": seq_len}
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.dims)

    def make(self, batch_size: int, seq_len: int) -> Tensor:
        """A tensor of this spec: zeros, or ones for a mask (every position attended)."""
        fill = 1 if "mask" in self.name else 0
        return torch.full(self.shape(batch_size, seq_len), fill, dtype=_DTYPES[self.dtype])

    def __str__(self) -> str:
        return f"{self.name}:{self.dtype}[{','.join(str(d) for d in self.dims)}]"


def parse_input(text: str) -> InputSpec:
    """An ``InputSpec`` from ``name:dtype[dims]``, dims integers or ``B``/``S``.

    Raises:
        PlanError: For text of another form, an unknown dtype or a dimension below 1.

    Examples:
        >>> parse_input("pixel_values:float32[B,3,224,224]").dims
        ('B', 3, 224, 224)
        >>> parse_input("input_ids:long[B,S]")
        Traceback (most recent call last):
        ...
        fsdp_guide.errors.PlanError: unknown dtype 'long' in 'input_ids:long[B,S]'; use one of ...
    """
    match = _SPEC_RE.match(text)
    if not match:
        raise PlanError(
            f"cannot read {text!r} as an input; write name:dtype[dims], e.g. "
            "input_ids:int64[B,S] (B: batch size, S: sequence length)"
        )
    name, dtype, raw = match.groups()
    if dtype not in _DTYPES:
        raise PlanError(f"unknown dtype {dtype!r} in {text!r}; use one of {', '.join(_DTYPES)}")
    dims: list[int | str] = []
    for part in (p.strip() for p in raw.split(",")):
        if part in ("B", "S"):
            dims.append(part)
        elif part.isdigit() and int(part) >= 1:
            dims.append(int(part))
        else:
            raise PlanError(f"dimension {part!r} of {text!r} must be B, S or an integer >= 1")
    return InputSpec(name=name, dtype=dtype, dims=tuple(dims))


@dataclass(frozen=True, kw_only=True)
class ExampleBatch:
    """How a model's example batch is built, and what it is, in words.

    Attributes:
        build: Makes ``(inputs, targets)`` for ``(batch_size, seq_len)``; the planner calls it
            under fake tensors, a training step outside them.
        description: The inputs as ``name:dtype[dims]`` and where the loss comes from.
        uses_seq_len: Whether a dimension is the sequence length (not for images or features).
    """

    build: BatchBuilder
    description: str
    uses_seq_len: bool
