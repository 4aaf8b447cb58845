"""The bytes of model state one rank holds: :class:`ModelState`.

Measured (:func:`fsdp_guide.memory.measure_model_state`) and predicted
(:func:`fsdp_guide.memory.estimate_model_state`) values share this type, so they can be
compared field by field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ModelState:
    """Bytes of parameters, gradients and optimizer state held by one rank.

    Attributes:
        params: Bytes of parameter storage (full tensors, or this rank's shards).
        grads: Bytes of gradient storage.
        optimizer: Bytes of optimizer state (Adam's moments and step counters, SGD's
            momentum buffers, fp32 master weights under mixed precision).
        total: ``params + grads + optimizer``, computed.

    Examples:
        >>> state = ModelState(params=400, grads=400, optimizer=800)
        >>> state.total
        1600
        >>> state.as_dict()
        {'params': 400, 'grads': 400, 'optimizer': 800, 'total': 1600}
    """

    params: int
    grads: int
    optimizer: int
    total: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("params", "grads", "optimizer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ModelState.{name} must be an int >= 0 bytes, got {value!r}")
        object.__setattr__(self, "total", self.params + self.grads + self.optimizer)

    def as_dict(self) -> dict[str, int]:
        """The four byte counts as a plain dict (for JSON).

        Examples:
            >>> ModelState(1, 2, 3).as_dict()["total"]
            6
        """
        return asdict(self)
