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
        buckets: Bytes of communication buckets that hold a second copy of the gradients:
            DDP's gradient buckets when the gradients are not views of them
            (``gradient_as_bucket_view=False``). Not in the ZeRO formulas, which predict 0.
            Shown in the repr only when not 0.
        total: ``params + grads + optimizer + buckets``, computed.

    Examples:
        >>> state = ModelState(params=400, grads=400, optimizer=800)
        >>> state.total
        1600
        >>> state.as_dict()
        {'params': 400, 'grads': 400, 'optimizer': 800, 'buckets': 0, 'total': 1600}
        >>> ModelState(400, 400, 800, buckets=400)
        ModelState(params=400, grads=400, optimizer=800, buckets=400, total=2000)
    """

    params: int
    grads: int
    optimizer: int
    buckets: int = 0
    total: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("params", "grads", "optimizer", "buckets"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ModelState.{name} must be an int >= 0 bytes, got {value!r}")
        total = self.params + self.grads + self.optimizer + self.buckets
        object.__setattr__(self, "total", total)

    def __repr__(self) -> str:
        # Buckets are rare (one DDP setting): keep the common repr to the ZeRO's three kinds.
        extra = f", buckets={self.buckets}" if self.buckets else ""
        return (
            f"ModelState(params={self.params}, grads={self.grads}, "
            f"optimizer={self.optimizer}{extra}, total={self.total})"
        )

    def as_dict(self) -> dict[str, int]:
        """The four byte counts as a plain dict (for JSON).

        Examples:
            >>> ModelState(1, 2, 3).as_dict()["total"]
            6
        """
        return asdict(self)
