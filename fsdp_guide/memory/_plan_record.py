"""What :func:`fsdp_guide.memory.plan` returns: the :class:`Plan` of one strategy (private)."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_guide.comm import CommPrediction
from fsdp_guide.memory._accumulation import Accumulation
from fsdp_guide.memory._pp_record import PipelinePlan
from fsdp_guide.memory._state import ModelState


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What one rank holds at its peak in a training step, planned by :func:`plan`.

    Attributes:
        strategy: The catalog name of the strategy.
        world_size: Ranks.
        num_params: Parameters of the model (``Ψ``).
        precision: ``"fp32"`` or ``"mixed"``.
        state: Parameters, gradients and optimizer state after ``optimizer.step()`` on the
            fullest rank (the one that must fit).
        activations: Bytes autograd saves for backward in this rank's forward.
        transient: The largest buffer that exists only for a while: FSDP's gathered unit (its
            parameters and unsharded gradients), DDP's gradient bucket, the parameters
            DeepSpeed ZeRO-3 holds gathered as backward starts.
        transient_kind: What ``transient`` is, in words.
        communication: The communication of one optimizer step (with ``grad_accumulation``
            micro-steps, of all of them).
        cpu_offload: Whether the whole model state lives in host memory (FSDP1's
            ``CPUOffload``).
        ranks: The state of each rank, ``ranks[r]`` for rank ``r``: they differ where the
            optimizer owns whole tensors or a shard is padded.
        exact_state: Whether ``ranks`` follow the engine's layout to the byte (``False``:
            the ZeRO formula, for an engine the planner does not know).
        between_steps: The state each rank keeps between steps, ``between_steps[r]`` for
            rank ``r``: ``ranks`` less the gradients and buckets ``zero_grad()`` frees (what
            :func:`~fsdp_guide.memory.measure_model_state` counts after it).
        step_peak: The most bytes held at once on the accelerator during a steady training
            step, on the fullest rank (what must fit): the state kept between steps on the
            accelerator (gradients freed by ``zero_grad()`` left out, buckets an engine keeps
            for the whole run, such as DDP's, counted), and the activations, gradients and
            buffers alive at that moment, as the engine says
            (:meth:`fsdp_guide.engines.Engine.step_peak`).
        step_peak_phase: Where in the step it falls.
        step_peak_kind: What is held then beyond the state, in words.
        tensor_parallel: Ranks of each tensor-parallel group (1: none); the state,
            activations and communication are then those of one rank of a
            ``(world_size // tensor_parallel, tensor_parallel)`` mesh.
        units: How the model is cut into units, in words (``"a unit per Block (2) + the
            root"``, ``"the whole model (root)"``), for a strategy whose figures follow the
            cut (``plan``'s ``policy``); empty for the others.
        sequence_parallel: Whether the norms and the residual stream are cut along the
            sequence over the tensor-parallel ranks too.
        kept_params: Bytes of whole parameters still gathered when forward returns,
            beyond the state, alive with the activations: DeepSpeed ZeRO-3 keeps those it
            uses again soon (every one of a small model); 0 for the other strategies.
        host_ranks: The part of each rank's state kept in host memory (what the engine
            offloads: DeepSpeed's ``offload_optimizer``, FSDP2's ``CPUOffloadPolicy``);
            the rest is on the accelerator. On a CPU run both are the process's memory.
        rank_peaks: :attr:`step_peak` of each rank, ``rank_peaks[r]`` for rank ``r``.
        pipeline_parallel: Pipeline ranks (1: none); the ranks are then a ``(pp, dp, tp)``
            mesh, ``ranks`` are every rank's and the other figures those of the pipeline rank
            whose total is the largest.
        pipeline: The stages, the schedule and each pipeline rank's plan; ``None`` without
            a pipeline.
        context_parallel: Ranks of each context-parallel group (1: none); the activations
            and the ring's messages are then those of a rank computing ``seq_len / c``
            tokens.
        expert_parallel: Ranks of each expert-parallel group (1: none).
        all_to_all: With expert parallelism, each rank of an expert-parallel group's
            all-to-all payload elements per step, ``all_to_all[r]`` for its ``r``-th rank
            (``communication`` holds the largest); empty otherwise.
        trainable_params: Parameters that train (``requires_grad``): they alone have
            gradients and optimizer state.
        frozen_params: Parameters that do not (a frozen base under LoRA adapters).
        accumulation: What ``grad_accumulation`` micro-steps per optimizer step hold and
            send; ``None`` for one micro-step.
    """

    strategy: str
    world_size: int
    num_params: int
    precision: str
    state: ModelState
    activations: int
    transient: int
    transient_kind: str
    communication: CommPrediction
    cpu_offload: bool = False
    ranks: tuple[ModelState, ...] = ()
    exact_state: bool = True
    between_steps: tuple[ModelState, ...] = ()
    step_peak: int = 0
    step_peak_phase: str = ""
    step_peak_kind: str = ""
    tensor_parallel: int = 1
    units: str = ""
    sequence_parallel: bool = False
    kept_params: int = 0
    host_ranks: tuple[ModelState, ...] = ()
    rank_peaks: tuple[int, ...] = ()
    pipeline_parallel: int = 1
    pipeline: PipelinePlan | None = None
    context_parallel: int = 1
    expert_parallel: int = 1
    all_to_all: tuple[int, ...] = ()
    trainable_params: int = 0
    frozen_params: int = 0
    accumulation: Accumulation | None = None

    @property
    def fullest_rank(self) -> int:
        """The rank whose state is ``state`` (the lowest, when several hold as much); with a
        pipeline, the lowest rank whose total is the largest."""
        if self.pipeline is not None:
            totals = [self.rank_total(r) for r in range(self.world_size)]
            return totals.index(max(totals))
        return self.ranks.index(self.state) if self.state in self.ranks else 0

    def host(self, rank: int | None = None) -> ModelState:
        """The model state the fullest rank (or ``rank``) keeps in host memory: what the
        engine offloads, or all of it with ``cpu_offload``."""
        index = self.fullest_rank if rank is None else rank
        if self.cpu_offload:
            return self.ranks[index] if self.ranks else self.state
        if not self.host_ranks:
            return ModelState(0, 0, 0)
        return self.host_ranks[index]

    @property
    def device_state(self) -> int:
        """Bytes of model state on the accelerator of the fullest rank.

        The state, less what lives in host memory (:meth:`host`).
        """
        return self.state.total - self.host().total

    @property
    def total(self) -> int:
        """Bytes on the accelerator of the fullest rank.

        Model state, activations and the transient buffer, each a column of ``estimate``'s
        table; the step's peak is :attr:`step_peak`.
        """
        return self.device_state + self.activations + self.transient

    def rank_total(self, rank: int) -> int:
        """:attr:`total` of ``rank``."""
        if self.pipeline is not None:  # its stages' activations and buffers
            return self.pipeline.plan_of(rank).rank_total(rank)
        state = self.ranks[rank].total - self.host(rank).total
        return state + self.activations + self.transient

    def rank_step_peak(self, rank: int | None = None) -> int:
        """The step's peak on the accelerator of ``rank`` (the fullest by default)."""
        if rank is None or not self.rank_peaks:
            return self.step_peak
        return self.rank_peaks[rank]

    def fits(
        self,
        gpu_memory: int,
        margin: float = 0.1,
        rank: int | None = None,
        host_memory: int | None = None,
    ) -> bool:
        """Whether the step's peak on the accelerator of the fullest rank (or ``rank``) fits
        ``gpu_memory`` less the ``margin`` share, and what it keeps in host memory fits
        ``host_memory`` when one is given.

        Examples:
            >>> from fsdp_guide.memory import plan
            >>> from fsdp_guide.models import MLP
            >>> p = plan(MLP(4, 8, 1, 2), batch_size=2, seq_len=1, world_size=2, strategy="ddp")
            >>> p.fits(p.step_peak), p.fits(p.step_peak, margin=0.0)
            (False, True)
            >>> p.fits(p.step_peak, margin=0.0, host_memory=0)  # DDP keeps nothing there
            True
        """
        on_host = self.host(rank).total
        return self.rank_step_peak(rank) <= gpu_memory * (1 - margin) and (
            host_memory is None or on_host <= host_memory
        )

    def device(self, rank: int | None = None) -> ModelState:
        """The model state the fullest rank (or ``rank``) keeps on the accelerator, field by
        field: its state less what lives in host memory (:meth:`host`)."""
        index = self.fullest_rank if rank is None else rank
        whole, host = (self.ranks[index] if self.ranks else self.state), self.host(index)
        fields = ("params", "grads", "optimizer", "buckets", "master")
        return ModelState(**{f: getattr(whole, f) - getattr(host, f) for f in fields})

    def as_dict(self, rank: int | None = None) -> dict[str, int | str | bool]:
        """The plan of one rank (the fullest by default) as JSON-ready values, bytes as integers.

        ``params`` to ``master`` are what the rank keeps on the accelerator, ``host_params``
        to ``host_master`` what it keeps in host memory; ``total`` adds the accelerator's
        columns (state, activations, transient buffer), ``step_peak`` is what must fit.

        Examples:
            >>> from fsdp_guide.memory import plan
            >>> from fsdp_guide.models import MLP
            >>> p = plan(MLP(4, 8, 1, 2), batch_size=2, seq_len=1, world_size=2, strategy="zero1")
            >>> p.as_dict()["activations"], p.as_dict()["total"] == p.total
            (128, True)
            >>> [p.as_dict(r)["optimizer"] for r in range(2)]  # tensors of 32 and 8+16+2 elements
            [260, 220]
        """
        index = self.fullest_rank if rank is None else rank
        if self.pipeline is not None:
            row = self.pipeline.plan_of(index).as_dict(index)
            row["pipeline_rank"] = self.pipeline.pipeline_rank(index)
            row["stages"] = ",".join(map(str, self.pipeline.stages_of(index)))
            row["schedule"] = self.pipeline.schedule.name
            row["microbatches"] = self.pipeline.schedule.microbatches
            return {**row, "pipeline_parallel": self.pipeline_parallel}
        state = self.ranks[index] if self.ranks else self.state
        device, host = self.device(index), self.host(index)
        return {
            "strategy": self.strategy,
            "rank": index,
            "world_size": self.world_size,
            "num_params": self.num_params,
            "precision": self.precision,
            "cpu_offload": host.total > 0,
            **{k: v for k, v in device.as_dict().items() if k != "total"},
            **{f"host_{k}": v for k, v in host.as_dict().items() if k != "total"},
            "host": host.total,
            "model_state": state.total,
            "exact_state": self.exact_state,
            "activations": self.activations,
            "transient": self.transient,
            "transient_kind": self.transient_kind,
            "communication": self.communication.payload_bytes,
            "payload": self.communication.payload_bytes,
            "wire": round(self.communication.wire_bytes()),
            "total": self.rank_total(index) if self.ranks else self.total,
            "step_peak": self.rank_step_peak(index),
            "step_peak_phase": self.step_peak_phase,
            "step_peak_kind": self.step_peak_kind,
            "tensor_parallel": self.tensor_parallel,
            "units": self.units,
            "sequence_parallel": self.sequence_parallel,
            "kept_params": self.kept_params,
            "trainable_params": self.trainable_params,
            "frozen_params": self.frozen_params,
            "context_parallel": self.context_parallel,
            "expert_parallel": self.expert_parallel,
            **self._accumulation_dict(index),
        }

    def _accumulation_dict(self, rank: int) -> dict[str, int | str | bool]:
        acc = self.accumulation
        if acc is None:
            return {"grad_accumulation": 1}
        return {
            "grad_accumulation": acc.micro_steps,
            "sync_each_micro_step": acc.sync_each_micro_step,
            "held_between_micro_steps": acc.held[rank],
            "communication_per_optimizer_step": sum(acc.payload_bytes.values()),
        }
