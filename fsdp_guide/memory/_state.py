"""The bytes of model state one rank holds: ``ModelState``.

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
            (``gradient_as_bucket_view=False``), kept for the whole run. Not in the ZeRO
            formulas, which predict 0.
            Also DeepSpeed's reduce buckets that stay allocated after the step (ZeRO-3's
            ``ipg`` bucket, the offload staging buffers of ZeRO-1/2), see
            :func:`~fsdp_guide.memory.estimate_deepspeed_state`. Shown in the repr only
            when not 0.
        master: Bytes of an fp32 master copy of the parameters kept in a tensor of its own
            beside ``params``: DeepSpeed's ZeRO optimizers keep one even when the model is
            fp32. The ZeRO formulas count a master copy in ``optimizer`` (mixed precision)
            and predict 0 here. Shown in the repr only when not 0.
        total: ``params + grads + optimizer + buckets + master``, computed.

    Examples:
        >>> state = ModelState(params=400, grads=400, optimizer=800)
        >>> state.total
        1600
        >>> state.as_dict()
        {'params': 400, 'grads': 400, 'optimizer': 800, 'buckets': 0, 'master': 0, 'total': 1600}
        >>> ModelState(400, 400, 800, buckets=400)
        ModelState(params=400, grads=400, optimizer=800, buckets=400, total=2000)
        >>> ModelState(400, 200, 400, master=200)
        ModelState(params=400, master=200, grads=200, optimizer=400, total=1200)
    """

    params: int
    grads: int
    optimizer: int
    buckets: int = 0
    master: int = 0
    total: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("params", "grads", "optimizer", "buckets", "master"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ModelState.{name} must be an int >= 0 bytes, got {value!r}")
        total = self.params + self.grads + self.optimizer + self.buckets + self.master
        object.__setattr__(self, "total", total)

    def __repr__(self) -> str:
        # Buckets and a separate master copy are rare (one DDP setting, DeepSpeed): keep the
        # common repr to the ZeRO's three kinds.
        master = f", master={self.master}" if self.master else ""
        buckets = f", buckets={self.buckets}" if self.buckets else ""
        return (
            f"ModelState(params={self.params}{master}, grads={self.grads}, "
            f"optimizer={self.optimizer}{buckets}, total={self.total})"
        )

    def as_dict(self) -> dict[str, int]:
        """The byte counts and their total as a plain dict (for JSON).

        Examples:
            >>> ModelState(1, 2, 3).as_dict()["total"]
            6
        """
        return asdict(self)
