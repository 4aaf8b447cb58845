"""The ZeRO paper's communication volume per training step, and what each strategy issues (private).

ZeRO (Rajbhandari et al., 2020, section 7) counts what one rank moves per step, for ``Ψ``
parameters: data parallelism (stage 0) and ZeRO-1/2 move ``2Ψ``, ZeRO-3 ``3Ψ``. Three units
meet here, and the gap between them is the lesson:

* **Payload**, what :func:`fsdp_guide.comm.count_collectives` measures: the elements of the
  logical tensor of each collective (the tensor all-reduced; the full tensor of a
  reduce-scatter or an all-gather). DDP issues one all-reduce of ``Ψ`` elements: payload Ψ.
* **The paper's convention**: an all-reduce counts ``2Ψ``, because the paper builds it from a
  reduce-scatter (``Ψ``) and an all-gather (``Ψ``); every other collective counts its payload.
  So DDP is ``2Ψ``, ZeRO-3's reduce-scatter plus two all-gathers ``3Ψ``.
* **The wire**: what a rank really sends in a ring over ``g`` ranks: ``2(g-1)/g`` of the
  payload for an all-reduce, ``(g-1)/g`` for the others; the paper's figure is its limit for
  large ``g``. Gloo runs a reduce-scatter as an all-reduce on the wire (``2(g-1)/g``).

And the implementations differ from the paper's algorithms: FairScale OSS and
ZeroRedundancyOptimizer all-reduce the full gradient and then broadcast each updated shard
(payload ``2Ψ``, paper convention ``3Ψ``, not ``2Ψ``); ShardedDDP reduces each gradient to
its owner and broadcasts (``2Ψ``); FSDP does not gather the root unit again in backward, as
it keeps it unsharded after forward, so ZeRO-3's all-gathers are ``2Ψ - R`` for a root unit of
``R`` parameters (FSDP1 with the whole model as one unit gathers ``Ψ`` in all).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from fsdp_guide.catalog import get_strategy
from fsdp_guide.engines import Engine, ModelShape, engine_for
from fsdp_guide.launcher import check_world_size

_DTYPE_SIZES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp64": 8}


@dataclass(frozen=True, kw_only=True)
class CommPrediction:
    """Predicted communication of one rank in one training step.

    Attributes:
        strategy: The strategy name, or ``"zero0"``-``"zero3"`` for the paper's own algorithm.
        num_params: ``Ψ``.
        world_size: ``N``.
        element_size: Bytes per element communicated.
        payload: Payload elements per collective kind that the strategy issues.
        group_sizes: Ranks in the group of each kind (a hybrid strategy's all-reduce spans
            the replicas, its reduce-scatter and all-gather one shard group).
        paper_elements: The ZeRO paper's figure for the strategy's stage: ``2Ψ`` or ``3Ψ``.
        once: Payload elements per kind issued once, outside the steady step (DDP's
            broadcasts when it wraps the model and when it regroups its buckets); known
            when the model's shape is given, else empty.
        element_sizes: Bytes per element of a kind, where it is not ``element_size``: the
            gradients' collectives carry the reduce precision (fp32 under FSDP2's
            ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``), the parameters' the
            compute precision.
        inter_node: The kinds whose group spans more than one node (given the GPUs per
            node): their wire bytes cross the network between nodes, the others stay on
            a node's own links.
    """

    strategy: str
    num_params: int
    world_size: int
    element_size: int
    payload: Mapping[str, int]
    group_sizes: Mapping[str, int] = field(default_factory=dict)
    paper_elements: int = 0
    once: Mapping[str, int] = field(default_factory=dict)
    element_sizes: Mapping[str, int] = field(default_factory=dict)
    inter_node: tuple[str, ...] = ()

    @property
    def payload_elements(self) -> int:
        """The payload elements of every kind together."""
        return sum(self.payload.values())

    def bytes_per_element(self, kind: str) -> int:
        """Bytes per element of ``kind``'s collectives."""
        return self.element_sizes.get(kind, self.element_size)

    @property
    def payload_bytes(self) -> int:
        """Payload bytes of every kind together, what ``count_collectives`` measures: the
        tensor all-reduced, the full tensor reduce-scattered, all-gathered or broadcast.

        Examples:
            >>> fsdp2 = predict_communication("fsdp2", 1000, 2, "bf16", reduce_dtype="fp32")
            >>> fsdp2.payload_bytes  # 1000 gradients in fp32, 2000 parameters in bf16
            8000
        """
        return sum(n * self.bytes_per_element(k) for k, n in self.payload.items())

    def wire_bytes(self, algorithm: Literal["ring", "gloo"] = "ring", link: str = "") -> float:
        """Bytes this rank sends on the wire in one step (:meth:`wire_elements`, in bytes):
        ``2(g-1)/g`` of an all-reduce's payload, ``(g-1)/g`` of an all-gather's, a
        reduce-scatter's or a broadcast's, over a group of ``g`` ranks. ``link``:
        ``"inter"`` counts the kinds whose group spans nodes (:attr:`inter_node`),
        ``"intra"`` the others, ``""`` all.

        Examples:
            >>> ddp = predict_communication("ddp", 1000, 8)  # 4000 bytes all-reduced
            >>> ddp.payload_bytes, ddp.wire_bytes()
            (4000, 7000.0)
        """
        total = 0.0
        for kind, elements in self.payload.items():
            crosses = kind in self.inter_node
            if (link == "inter" and not crosses) or (link == "intra" and crosses):
                continue
            total += self.bytes_per_element(kind) * self._wire(kind, elements, algorithm)
        return total

    @property
    def paper_bytes(self) -> int:
        """The ZeRO paper's figure in bytes."""
        return self.paper_elements * self.element_size

    @property
    def convention_elements(self) -> int:
        """The payload in the paper's convention, where an all-reduce counts twice.

        Examples:
            >>> oss = predict_communication("oss", 1000, 2)
            >>> oss.payload_elements, oss.convention_elements, oss.paper_elements
            (2000, 3000, 2000)
        """
        return sum(n * (2 if k == "all_reduce" else 1) for k, n in self.payload.items())

    def wire_elements(self, algorithm: Literal["ring", "gloo"] = "ring") -> float:
        """Elements this rank sends on the wire, on average over ranks.

        ``"ring"``: ``2(g-1)/g`` of an all-reduce's payload, ``(g-1)/g`` of the others'.
        ``"gloo"``: the same, except that gloo runs a reduce-scatter as an all-reduce.

        Examples:
            >>> predict_communication("ddp", 1000, 4).wire_elements()
            1500.0
            >>> fsdp = predict_communication("fsdp_grad_op", 1000, 2)
            >>> fsdp.wire_elements(), fsdp.wire_elements("gloo")
            (1000.0, 1500.0)
        """
        return sum(self._wire(k, n, algorithm) for k, n in self.payload.items())

    def _wire(self, kind: str, elements: int, algorithm: str) -> float:
        g = self.group_sizes.get(kind, self.world_size)
        twice = kind == "all_reduce" or (algorithm == "gloo" and kind == "reduce_scatter")
        return elements * (2 if twice else 1) * (g - 1) / g


def _element_size(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if dtype in _DTYPE_SIZES:
        return _DTYPE_SIZES[dtype]
    raise ValueError(
        f"unknown dtype {dtype!r}; use a torch.dtype or one of {', '.join(_DTYPE_SIZES)}"
    )


def predict_communication(
    strategy: str,
    num_params: int,
    world_size: int,
    dtype: torch.dtype | str = "fp32",
    root_unit_params: int = 0,
    shape: ModelShape | None = None,
    reduce_dtype: torch.dtype | str | None = None,
    gpus_per_node: int | None = None,
    engine: Engine | None = None,
) -> CommPrediction:
    """Payload per collective kind that one rank issues in one training step, and ZeRO's figure.

    What each strategy issues per step (``Ψ`` parameters, ``N`` ranks, shard groups of ``S``):

    ======================================== ============================================ =====
    strategy                                 payload per kind                             paper
    ======================================== ============================================ =====
    ``ddp``, ``fsdp_no_shard``, zero0        all-reduce Ψ                                 2Ψ
    ``zero1``, ``oss``                       all-reduce Ψ, broadcast Ψ                    2Ψ
    ``sharded_ddp(_buckets)``                reduce Ψ, broadcast Ψ                        2Ψ
    ``fsdp_grad_op``, zero2                  reduce-scatter Ψ, all-gather Ψ               2Ψ
    ``fsdp``, ``fsdp2``, FairScale, zero3    reduce-scatter Ψ, all-gather 2Ψ - R          3Ψ
    ``fsdp_hybrid``                          as ``fsdp`` in groups of S, all-reduce Ψ/S   3Ψ
    ``deepspeed_zero1``, ``deepspeed_zero2`` all-reduce Ψ + 1, all-gather Ψ'              2Ψ
    ``deepspeed_zero3``                      reduce-scatter Ψ, all-gather Ψ, all-reduce 1 3Ψ
    ======================================== ============================================ =====

    ``R`` is the root unit's parameters: FSDP keeps the root unit unsharded from forward to
    backward, so only the other units are gathered twice (``R = Ψ`` when the whole model is
    one unit). The paper's zero3 has ``R = 0``. The hybrid
    all-reduce of each ``Ψ/S`` gradient shard spans the ``N/S`` replicas; FSDP1 issues it
    even when there is one replica (it sends nothing then).

    DeepSpeed (measured with 0.19.8 on gloo, the offload variants alike): ZeRO-1 and 2
    all-reduce the whole gradient, not a reduce-scatter, then all-gather the updated
    partitions of the flat buffer padded to ``Ψ'``, a multiple of ``2N``; the ``+ 1`` and
    ZeRO-3's one-element all-reduce are the overflow check. ZeRO-3 gathers each
    parameter once per step: it keeps what forward gathered for backward while the
    model is below ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` (10⁹
    elements by default); past them, up to twice. Its payloads are also padded, each
    tensor to a multiple of ``N``, which ``Ψ`` alone cannot tell (exact when every tensor
    divides by ``N``). From the third step on: ZeRO-3's second step also broadcasts a
    few hundred elements once, while DeepSpeed settles its prefetch order.

    What DDP (and ZeroRedundancyOptimizer and OSS over it) sends once is apart, in
    ``once``, given the model's shape: when it wraps the model, an
    all-gather of one element a rank and broadcasts of rank 0's parameter sizes and strides,
    parameters and buffers; at the start of the second forward, the broadcast of its
    regrouped buckets' layout.

    Args:
        strategy: A name from :data:`fsdp_guide.catalog.STRATEGIES`, or ``"zero0"``,
            ``"zero2"``, ``"zero3"`` for the paper's algorithm (``"zero1"`` is the catalog's
            ZeroRedundancyOptimizer).
        num_params: ``Ψ``.
        world_size: ``N``.
        dtype: What is communicated: a ``torch.dtype`` or ``"fp32"``, ``"fp16"``, ``"bf16"``.
        root_unit_params: ``R`` for the fully sharded strategies; ignored by the others.
        shape: The model's units and buffers (:func:`fsdp_guide.engines.model_shape`), for
            what ``Ψ`` alone cannot tell: the padding of FSDP's flat parameters and row
            chunks and of DeepSpeed's partitions, and DDP's broadcast of the buffers before
            each forward (BatchNorm statistics, position ids). It gives ``Ψ`` and ``R``:
            ``num_params`` must equal its ``Ψ``, ``root_unit_params`` is not read.
        reduce_dtype: What the gradients' collectives (all-reduce, reduce-scatter, reduce)
            carry, where it is not ``dtype``: FSDP2's ``MixedPrecisionPolicy(reduce_dtype=)``.
        gpus_per_node: GPUs of a node: a collective whose group spans more than one node is
            counted in :attr:`CommPrediction.inter_node` (HSDP's all-reduce across the
            replicas; every collective of a group larger than a node).
        engine: The strategy's engine with other settings than the catalog row's (a
            DeepSpeed ZeRO-3 reuse distance, say); by default the row's.

    Returns:
        A ``CommPrediction``.

    Raises:
        ValueError: For an unknown strategy or dtype, a world size below 1, or a negative
            ``num_params`` or ``root_unit_params`` above ``num_params``.

    Examples:
        >>> ddp = predict_communication("ddp", 1000, 2)
        >>> dict(ddp.payload), ddp.payload_bytes, ddp.paper_elements
        ({'all_reduce': 1000}, 4000, 2000)
        >>> fsdp = predict_communication("fsdp2", 1000, 2, "bf16", root_unit_params=100)
        >>> dict(fsdp.payload), fsdp.payload_bytes, fsdp.paper_bytes
        ({'reduce_scatter': 1000, 'all_gather': 1900}, 5800, 6000)
        >>> dict(predict_communication("deepspeed_zero2", 1001, 2).payload)
        {'all_reduce': 1002, 'all_gather': 1004}
        >>> from fsdp_guide.engines import ModelShape
        >>> one = ModelShape(units=(((5, 3),),))  # one 5 x 3 weight, no buffer
        >>> dict(predict_communication("ddp", 15, 2, shape=one).once)  # 15 + 2 * 2, then 3
        {'all_gather': 2, 'broadcast': 22}
        >>> predict_communication("zero5", 1, 1)
        Traceback (most recent call last):
        ...
        ValueError: unknown strategy 'zero5'; choose from ddp, zero1, oss, sharded_ddp, ...
    """
    check_world_size(world_size)
    psi = num_params
    if isinstance(psi, bool) or not isinstance(psi, int) or psi < 0:
        raise ValueError(f"num_params must be an int >= 0, got {num_params!r}")
    if not 0 <= root_unit_params <= psi:
        raise ValueError(
            f"root_unit_params must be between 0 and num_params={psi}, got {root_unit_params}"
        )
    size = _element_size(dtype)
    if shape is not None and shape.num_params != psi:
        raise ValueError(f"num_params={psi} but the shape has {shape.num_params} parameters")
    once: dict[str, int] = {}
    if strategy in _PAPER:  # the paper's own algorithm, no engine
        stage, name = int(strategy[-1]), strategy
        payload, groups = _PAPER[strategy](psi, world_size, root_unit_params)
    else:
        spec = get_strategy(strategy)
        stage, name = spec.zero_stage, spec.name
        engine = engine or engine_for(spec)
        issued = (
            engine.collectives(psi, world_size, root_unit_params)
            if shape is None
            else engine.step_collectives(shape, world_size)
        )
        payload, groups = dict(issued.payload), dict(issued.groups)
        if shape is not None:
            once = dict(engine.once_collectives(shape, world_size).payload)
    sizes: dict[str, int] = {}
    if reduce_dtype is not None:
        reduced = _element_size(reduce_dtype)
        sizes = {k: reduced for k in payload if k in _GRADIENT_KINDS and reduced != size}
    crossing: tuple[str, ...] = ()
    if gpus_per_node is not None:
        replicas = world_size // max(groups.get("reduce_scatter", world_size), 1)
        crossing = tuple(
            kind
            for kind in payload
            if (
                replicas > 1 and world_size > gpus_per_node
                if kind == "all_reduce" and kind in groups
                else groups.get(kind, world_size) > gpus_per_node
            )
        )
    return CommPrediction(
        strategy=name,
        num_params=psi,
        world_size=world_size,
        element_size=size,
        payload=payload,
        group_sizes=groups,
        paper_elements=(3 if stage == 3 else 2) * psi,
        once=once,
        element_sizes=sizes,
        inter_node=crossing,
    )


#: The collectives that carry gradients, in the reduce precision.
_GRADIENT_KINDS = frozenset({"all_reduce", "reduce_scatter", "reduce"})


_Payload = tuple[dict[str, int], dict[str, int]]
# ZeRO's algorithms as the paper describes them: DDP's all-reduce, stage 2's reduce-scatter
# and all-gather, stage 3's two gathers per unit (the root gathered once).
_PAPER: dict[str, Callable[[int, int, int], _Payload]] = {
    "zero0": lambda psi, n, root: ({"all_reduce": psi}, {}),
    "zero2": lambda psi, n, root: ({"reduce_scatter": psi, "all_gather": psi}, {}),
    "zero3": lambda psi, n, root: (
        {"reduce_scatter": psi, "all_gather": 2 * psi - root},
        {"reduce_scatter": n, "all_gather": n},
    ),
}


def root_unit_params(module: nn.Module) -> int:
    """Parameters of a fully sharded model's root unit: gathered once per step, not twice.

    FSDP1 (``FullyShardedDataParallel``) and FSDP2 (``fully_shard``) keep the root unit's
    parameters unsharded between forward and backward; every other unit is gathered again in
    backward. The root unit holds the parameters not inside a nested unit. The engine that
    wrapped ``module`` counts them (:meth:`fsdp_guide.engines.Engine.root_unit_params`).

    Args:
        module: The wrapped model (the root FSDP1 module or the FSDP2 root module).

    Returns:
        The root unit's parameter count, ``0`` for a module that is not fully sharded.

    Examples:
        >>> root_unit_params(nn.Linear(2, 2))
        0
    """
    return engine_for(module).root_unit_params(module)
