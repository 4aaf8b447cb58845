"""What an engine's answers are made of: :class:`Layout`, :class:`Collectives` and
``Transient`` (private).

Counted in **elements**, not bytes: an engine decides how many parameter, gradient and
optimizer-state elements a rank keeps, the precision decides how many bytes each is
(``bytes_per_param``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What one rank holds after ``optimizer.step()``, in elements.

    Attributes:
        params: Parameter elements, padding included.
        grads: Gradient elements kept after the step.
        optimizer: Elements whose optimizer state (Adam's two moments) this rank keeps.
        steps: Optimizer step tensors (Adam keeps a 0-d ``step`` per tensor it updates).
        master: Elements of an fp32 master copy kept apart from ``params`` (DeepSpeed).
        buckets: Elements of communication buckets kept between steps (DeepSpeed ZeRO-3's
            reduce bucket, its offload staging buffers).
        master_grads: Elements of the master copy's own gradient, kept in fp32 whatever the
            model's precision and counted with the gradients (DeepSpeed's offloaded optimizer).

    Examples:
        >>> Layout(params=10, grads=10, optimizer=5, steps=1)
        Layout(params=10, grads=10, optimizer=5, steps=1, master=0, buckets=0, master_grads=0)
    """

    params: int
    grads: int
    optimizer: int
    steps: int
    master: int = 0
    buckets: int = 0
    master_grads: int = 0


@dataclass(frozen=True, kw_only=True)
class Collectives:
    """The collectives one rank issues in one training step, by kind.

    Attributes:
        payload: Payload elements per kind (``"all_reduce"``, ``"reduce_scatter"``, ...):
            the tensor all-reduced, the full tensor reduce-scattered or all-gathered.
        groups: Ranks in the group of a kind, where it is not every rank (a hybrid
            engine's reduce-scatter spans one shard group, its all-reduce the replicas).

    Examples:
        >>> Collectives(payload={"all_reduce": 10}).groups
        {}
    """

    payload: Mapping[str, int]
    groups: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Transient:
    """The largest buffer a rank holds only for a while during a step, beyond its state.

    Attributes:
        bytes: Its size.
        kind: What it is, in words.
    """

    bytes: int
    kind: str
