"""A pipeline schedule's step structure: which rank runs which action, in which order (private).

``torch.distributed.pipelining`` runs a step as a list of actions per rank: the forward of a
micro-batch through a stage (``F``), its backward (``B``), or, in the zero-bubble schedules,
the backward split in two, the input's gradient (``I``, what the previous stage waits for)
and the weights' gradient (``W``, which can wait). :func:`pipeline_schedule` reads that list
from torch's own schedule classes: for the multi-stage ones (``Interleaved1F1B``,
``InterleavedZeroBubble``, ``ZBVZeroBubble``) the ``pipeline_order`` their runtime executes,
built on stand-in stages as torch's schedule visualizer does; for ``GPipe`` and ``1F1B``,
whose ``step`` is a hand-written loop, the order that loop runs (its list for drawing numbers
the last stage's micro-batches from 1).

Everything else is derived from the lists: ``PipelineSchedule.timeline`` places each
action at the earliest time its rank is free and its inputs exist (the previous stage's
forward, the next stage's backward), for given costs per kind; ``PipelineSchedule.bubble``
is each rank's idle share of that step (or of a measured one); and
``PipelineSchedule.in_flight`` says how many micro-batches each stage holds activations
for after each action, which is what the activation peak of a schedule is made of.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from fsdp_guide.errors import PlanError

#: The schedules planned, by torch's names (``get_schedule_class`` takes any case), and how
#: many stages each rank holds: one, several (``0`` for "two by default, any number from
#: two"), or exactly two (the V shape).
SCHEDULES: Mapping[str, int] = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": 0,
    "InterleavedZeroBubble": 0,
    "ZBVZeroBubble": 2,
}


class PipelineAction(NamedTuple):
    """One compute action of a pipeline step: ``kind`` of ``microbatch`` through ``stage``.

    Its string is torch's (``"1F0"``: stage 1, forward, micro-batch 0).

    Examples:
        >>> str(PipelineAction(1, "F", 0)), PipelineAction.parse("3W2")
        ('1F0', PipelineAction(stage=3, kind='W', microbatch=2))
    """

    stage: int
    kind: str  # "F", "B", "I" or "W"
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> PipelineAction:
        """The action written ``text`` (``"0B3"``)."""
        for kind in ("F", "B", "I", "W"):
            stage, found, microbatch = text.partition(kind)
            if found and stage.isdigit() and microbatch.isdigit():
                return cls(int(stage), kind, int(microbatch))
        raise ValueError(f"not a pipeline action: {text!r} (stage, F/B/I/W, micro-batch)")


class TimedAction(NamedTuple):
    """An action placed in time: simulated in cost units, or measured in seconds."""

    action: PipelineAction
    start: float
    end: float


Timeline = tuple[tuple[TimedAction, ...], ...]
#: A step per rank, as ``TimedAction`` or as a run records it: ``("1F0", start, end)``.
Records = Sequence[Sequence[TimedAction | tuple[str, float, float]]]


def canonical_schedule(name: object) -> str:
    """torch's spelling of a schedule's name, any case accepted.

    Raises:
        PlanError: For a schedule this package does not plan.

    Examples:
        >>> canonical_schedule("interleaved1f1b")
        'Interleaved1F1B'
    """
    names = {k.lower(): k for k in SCHEDULES}
    found = names.get(name.lower()) if isinstance(name, str) else None
    if found is None:
        raise PlanError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    return found


def default_stages_per_rank(schedule: str) -> int:
    """Stages a rank holds under ``schedule`` unless told: 1 for GPipe and 1F1B, else 2."""
    return SCHEDULES[canonical_schedule(schedule)] or 2


def check_stages_per_rank(schedule: str, stages_per_rank: int) -> None:
    """Raise :class:`PlanError` when ``schedule`` cannot run ``stages_per_rank`` stages a rank."""
    name = canonical_schedule(schedule)
    fixed = SCHEDULES[name]
    if fixed == 0 and stages_per_rank < 2:
        raise PlanError(f"{name} interleaves stages: stages_per_rank must be >= 2")
    if fixed and stages_per_rank != fixed:
        raise PlanError(
            f"{name} runs {fixed} stage(s) per rank, not stages_per_rank={stages_per_rank}"
        )


@dataclass(frozen=True, kw_only=True)
class PipelineSchedule:
    """The actions each rank runs in one step of a pipeline schedule.

    Attributes:
        name: torch's name of the schedule (``"1F1B"``).
        ranks: Pipeline ranks ``p``.
        stages_per_rank: Stages each rank holds, ``v``.
        microbatches: Micro-batches per step, ``m``.
        actions: ``actions[r]``: what rank ``r`` runs, in order.
        stage_rank: ``stage_rank[s]``: the rank holding stage ``s``.
    """

    name: str
    ranks: int
    stages_per_rank: int
    microbatches: int
    actions: tuple[tuple[PipelineAction, ...], ...]
    stage_rank: tuple[int, ...]

    @property
    def stages(self) -> int:
        """Stages in all, ``p · v``."""
        return self.ranks * self.stages_per_rank

    @property
    def splits_backward(self) -> bool:
        """Whether the backward runs as ``I`` then ``W`` (the zero-bubble schedules)."""
        return any(a.kind == "W" for rank in self.actions for a in rank)

    def rank_stages(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` holds, in order."""
        return tuple(s for s, r in enumerate(self.stage_rank) if r == rank)

    @property
    def formula_bubble(self) -> float:
        """The textbook idle share of a step, ``(p - 1) / (v · m + p - 1)``: ``p - 1`` stage
        times of filling and draining, against ``v · m`` of work per rank (equal stages,
        free communication, and for interleaved stages at least ``p`` micro-batches; a
        zero-bubble schedule does better, see :meth:`bubble`).

        Examples:
            >>> pipeline_schedule("GPipe", ranks=4, microbatches=8).formula_bubble
            0.2727272727272727
        """
        p, v, m = self.ranks, self.stages_per_rank, self.microbatches
        return (p - 1) / (v * m + p - 1)

    def timeline(
        self,
        forward: float = 1.0,
        backward: float = 2.0,
        backward_input: float = 1.0,
        backward_weight: float = 1.0,
    ) -> Timeline:
        """Each rank's actions placed at the earliest time they can run.

        A rank runs its actions in order; a forward waits for the previous stage's forward
        of its micro-batch, a backward (or input-gradient) for the next stage's; sending
        takes no time. Costs are per action of one stage: by default a backward is twice a
        forward, and its two halves one each.

        Examples:
            >>> steps = pipeline_schedule("1F1B", ranks=2, microbatches=2).timeline()
            >>> [(str(t.action), t.start, t.end) for t in steps[1]]
            [('1F0', 1.0, 2.0), ('1B0', 2.0, 4.0), ('1F1', 4.0, 5.0), ('1B1', 5.0, 7.0)]
        """
        cost = {"F": forward, "B": backward, "I": backward_input, "W": backward_weight}
        done: dict[tuple[int, str, int], float] = {}  # (stage, kind, micro-batch) -> end
        placed: list[list[TimedAction]] = [[] for _ in self.actions]
        free = [0.0] * self.ranks
        position = [0] * self.ranks
        while any(position[r] < len(self.actions[r]) for r in range(self.ranks)):
            progress = False
            for r in range(self.ranks):
                while position[r] < len(self.actions[r]):
                    action = self.actions[r][position[r]]
                    ready = self._inputs_ready(action, done)
                    if ready is None:
                        break
                    start = max(free[r], ready)
                    end = start + cost[action.kind]
                    placed[r].append(TimedAction(action, start, end))
                    done[(action.stage, action.kind, action.microbatch)] = end
                    free[r] = end
                    position[r] += 1
                    progress = True
            if not progress:  # torch's lists never deadlock; a hand-made one might
                raise ValueError(f"{self.name}: no rank can run its next action")
        return tuple(tuple(rank) for rank in placed)

    def _inputs_ready(
        self, action: PipelineAction, done: Mapping[tuple[int, str, int], float]
    ) -> float | None:
        """When the inputs of ``action`` exist, or ``None`` while they are not yet placed."""
        s, mb = action.stage, action.microbatch
        if action.kind == "F":
            needed = [] if s == 0 else [(s - 1, "F", mb)]
        elif action.kind == "W":
            needed = [(s, "I", mb)]
        elif s == self.stages - 1:
            needed = [(s, "F", mb)]
        else:  # the next stage's input gradient: from its B or its I
            either = [done.get((s + 1, k, mb)) for k in ("B", "I")]
            ends = [e for e in either if e is not None]
            return min(ends) if ends else None
        found = [done[key] for key in needed if key in done]
        if len(found) < len(needed):
            return None
        return max(found, default=0.0)

    def bubble(self, timeline: Records | None = None) -> tuple[float, ...]:
        """Each rank's idle share of the step: 1 - its busy time / the step's span.

        Args:
            timeline: Per rank, its actions with their start and end: a measured step (the
                ``(action, start, end)`` records of a run, in seconds of one clock for all
                ranks), or by default the simulated one (:meth:`timeline`).

        Examples:
            >>> schedule = pipeline_schedule("GPipe", ranks=2, microbatches=4)
            >>> [round(b, 6) for b in schedule.bubble()], schedule.formula_bubble
            ([0.2, 0.2], 0.2)
        """
        steps = self.timeline() if timeline is None else timeline_of(timeline)
        first = min(t.start for rank in steps for t in rank)
        last = max(t.end for rank in steps for t in rank)
        span = last - first
        return tuple(1 - sum(t.end - t.start for t in rank) / span for rank in steps)

    @staticmethod
    def read(records: Records) -> Timeline:
        """Records of a step, ``(action, start, end)`` per rank with the action as torch
        writes it (``"1F0"``), as ``TimedAction`` s."""
        return timeline_of(records)

    def in_flight(self, rank: int) -> tuple[dict[int, int], ...]:
        """After each action of ``rank``: micro-batches whose activations each of its stages
        holds. A forward adds one; a full backward frees it; split in two, the weights'
        half frees it (the input's half keeps the graph for it).

        Examples:
            >>> flights = pipeline_schedule("1F1B", ranks=2, microbatches=4).in_flight(0)
            >>> [f[0] for f in flights]  # F0 F1 B0 F2 B1 F3 B2 B3
            [1, 2, 1, 2, 1, 2, 1, 0]
        """
        held = dict.fromkeys(self.rank_stages(rank), 0)
        after = []
        for action in self.actions[rank]:
            if action.kind == "F":
                held[action.stage] += 1
            elif action.kind in ("B", "W"):
                held[action.stage] -= 1
            after.append(dict(held))
        return tuple(after)


def _single_stage_actions(name: str, ranks: int, microbatches: int) -> list[list[PipelineAction]]:
    """What ``ScheduleGPipe`` and ``Schedule1F1B`` run: their ``step`` loops, written out."""
    out = []
    for stage in range(ranks):
        f = [PipelineAction(stage, "F", i) for i in range(microbatches)]
        b = [PipelineAction(stage, "B", i) for i in range(microbatches)]
        if name == "GPipe":
            out.append(f + b)
            continue
        warmup = min(microbatches, ranks - stage)  # the last stage runs one forward ahead
        order = f[:warmup]
        for i in range(microbatches - warmup):
            order += [b[i], f[warmup + i]]
        out.append(order + b[microbatches - warmup :])
    return out


def _multi_stage_actions(
    name: str, ranks: int, stages_per_rank: int, microbatches: int
) -> tuple[list[list[PipelineAction]], tuple[int, ...]]:
    """The ``pipeline_order`` torch's runtime executes, and the stage-to-rank map."""
    from unittest import mock

    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    # Stand-in stages carry what a schedule reads when it lays out its actions.
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, ranks, None
    stage.num_stages = ranks * stages_per_rank
    try:
        schedule = get_schedule_class(name)([stage] * stages_per_rank, microbatches)
    except ValueError as exc:
        raise PlanError(f"{name}: {exc}") from exc
    actions = [
        [
            PipelineAction.parse(str(a))
            for a in schedule.pipeline_order[r]
            if a is not None and a.is_compute_op
        ]
        for r in range(ranks)
    ]
    mapping = schedule.stage_index_to_group_rank
    return actions, tuple(mapping[s] for s in range(ranks * stages_per_rank))


def pipeline_schedule(
    name: str, *, ranks: int, microbatches: int, stages_per_rank: int | None = None
) -> PipelineSchedule:
    """The step of ``name`` on ``ranks`` pipeline ranks: each rank's actions, in order.

    Args:
        name: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``, ``"InterleavedZeroBubble"`` or
            ``"ZBVZeroBubble"`` (any case), the schedules of ``torch.distributed.pipelining``.
        ranks: Pipeline ranks ``p``.
        microbatches: Micro-batches per step ``m``.
        stages_per_rank: Stages per rank ``v``: 1 for GPipe and 1F1B, 2 by default for the
            others (ZBVZeroBubble takes exactly 2).

    Raises:
        PlanError: An unknown schedule, sizes below 1, a ``v`` the schedule does not run,
            or micro-batches the schedule refuses (1F1B needs ``m >= p``).

    Examples:
        >>> schedule = pipeline_schedule("1F1B", ranks=2, microbatches=3)
        >>> [" ".join(map(str, rank)) for rank in schedule.actions]
        ['0F0 0F1 0B0 0F2 0B1 0B2', '1F0 1B0 1F1 1B1 1F2 1B2']
    """
    canonical = canonical_schedule(name)
    for label, value in (("ranks", ranks), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{label} must be an int >= 1, got {value!r}")
    v = default_stages_per_rank(canonical) if stages_per_rank is None else stages_per_rank
    if isinstance(v, bool) or not isinstance(v, int):
        raise PlanError(f"stages_per_rank must be an int, got {v!r}")
    check_stages_per_rank(canonical, v)
    if canonical == "1F1B" and microbatches < ranks:
        raise PlanError(
            f"1F1B needs microbatches >= pipeline ranks ({microbatches} < {ranks}): torch's "
            "Schedule1F1B refuses fewer; use more micro-batches or GPipe"
        )
    if SCHEDULES[canonical] == 1:
        actions = _single_stage_actions(canonical, ranks, microbatches)
        stage_rank = tuple(range(ranks))
    else:
        actions, stage_rank = _multi_stage_actions(canonical, ranks, v, microbatches)
    return PipelineSchedule(
        name=canonical,
        ranks=ranks,
        stages_per_rank=v,
        microbatches=microbatches,
        actions=tuple(tuple(rank) for rank in actions),
        stage_rank=stage_rank,
    )


def timeline_of(records: Records) -> Timeline:
    """A timeline from each rank's records, ``(action, start, end)`` with the action as
    torch writes it (``"1F0"``) or as a ``PipelineAction``.

    Examples:
        >>> timeline_of([[("0F0", 0.0, 1.5)]])[0][0].action
        PipelineAction(stage=0, kind='F', microbatch=0)
    """
    return tuple(
        tuple(
            TimedAction(
                a if isinstance(a, PipelineAction) else PipelineAction.parse(a),
                float(s),
                float(e),
            )
            for a, s, e in rank
        )
        for rank in records
    )
