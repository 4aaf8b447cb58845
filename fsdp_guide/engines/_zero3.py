"""Which parameters DeepSpeed ZeRO-3 keeps gathered in a step: :func:`zero3_gathered` (private).

DeepSpeed records the order in which a step's modules run (forward, then backward) on its
first step and follows it on every later one. A module's parameters are gathered when it
starts; when it ends they are released unless

* they are persistent (at most ``stage3_param_persistence_threshold`` elements each,
  ``stage3_model_persistence_threshold`` in all): never partitioned at all;
* a module within ``stage3_max_reuse_distance`` elements ahead uses them again (the
  elements of every module's own parameters are added up from the next module on, and the
  search stops once they reach the distance); or
* the prefetcher has already looked past a later use of theirs.

After each module starts, the prefetcher walks on through the recorded order and gathers
up to ``stage3_prefetch_bucket_size`` elements of parameters not yet gathered (fewer when
``stage3_max_live_parameters`` would be passed), marking every use it walks past.

Backward runs the modules the other way round: a module starts its backward when forward
left it and ends it when forward entered it. So every parameter of a model whose forward
and backward fit in the reuse distance (1e9 elements by default) is still gathered when
forward returns, and of a large model only the last modules' are.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque

from fsdp_guide.engines._step import ModuleCalls

#: DeepSpeed's ``stage3_max_reuse_distance`` and ``stage3_max_live_parameters`` defaults.
DEFAULT_REUSE_DISTANCE = 1_000_000_000
DEFAULT_MAX_LIVE = 1_000_000_000


def persistent(calls: ModuleCalls, param_threshold: int, model_threshold: int) -> set[int]:
    """The parameters DeepSpeed never partitions, in the order it picks them."""
    picked: set[int] = set()
    total = 0
    for param, numel in enumerate(calls.numels):
        if numel + total > model_threshold:
            continue
        if numel <= param_threshold:
            picked.add(param)
            total += numel
    return picked


def zero3_gathered(
    calls: ModuleCalls,
    *,
    prefetch_bucket: int,
    reuse_distance: int = DEFAULT_REUSE_DISTANCE,
    max_live: int = DEFAULT_MAX_LIVE,
    param_threshold: int = 0,
    model_threshold: int = 2**63 - 1,
) -> tuple[int, int]:
    """Elements of whole parameters held (persistent ones included) when forward returns,
    and the most held from then until backward's first module with parameters ends.

    Examples:
        >>> from torch import nn
        >>> from fsdp_guide.engines import module_calls
        >>> calls = module_calls(nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 100)))
        >>> zero3_gathered(calls, prefetch_bucket=0)  # both reused in backward
        (20200, 20200)
        >>> zero3_gathered(calls, prefetch_bucket=0, reuse_distance=10_000)  # the last only
        (10100, 10100)
    """
    after_forward, peak, _ = _replay(
        calls, prefetch_bucket, reuse_distance, max_live, param_threshold, model_threshold
    )
    return after_forward, peak


def zero3_fetched(
    calls: ModuleCalls,
    *,
    prefetch_bucket: int,
    reuse_distance: int = DEFAULT_REUSE_DISTANCE,
    max_live: int = DEFAULT_MAX_LIVE,
    param_threshold: int = 0,
    model_threshold: int = 2**63 - 1,
) -> list[int]:
    """The parameters (indices into ``calls.numels``) a steady step all-gathers, once per
    gather: each when a module needs it and it is not held, or when the prefetcher reaches
    it. Below the reuse distance a small model gathers each parameter once; past it,
    backward gathers again what forward released.

    Examples:
        >>> from torch import nn
        >>> from fsdp_guide.engines import module_calls
        >>> calls = module_calls(nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 100)))
        >>> len(zero3_fetched(calls, prefetch_bucket=0))  # 2 weights, 2 biases, once each
        4
        >>> len(zero3_fetched(calls, prefetch_bucket=0, reuse_distance=10_000))  # the first again
        6
    """
    return _replay(
        calls, prefetch_bucket, reuse_distance, max_live, param_threshold, model_threshold
    )[2]


def _replay(
    calls: ModuleCalls,
    prefetch_bucket: int,
    reuse_distance: int,
    max_live: int,
    param_threshold: int,
    model_threshold: int,
) -> tuple[int, int, list[int]]:
    """Replay a steady step: (held when forward returns, the most held until backward's first
    module with parameters ends, every parameter gathered)."""
    totals: list[int] = []
    _walk(
        calls,
        totals,
        prefetch_bucket=prefetch_bucket,
        reuse_distance=reuse_distance,
        max_live=max_live,
        param_threshold=param_threshold,
        model_threshold=model_threshold,
    )
    return totals[0], totals[1], totals[2:]


def _walk(
    calls: ModuleCalls,
    totals: list[int],
    *,
    prefetch_bucket: int,
    reuse_distance: int = DEFAULT_REUSE_DISTANCE,
    max_live: int = DEFAULT_MAX_LIVE,
    param_threshold: int = 0,
    model_threshold: int = 2**63 - 1,
) -> None:
    """The coordinator's walk over forward and backward; ``totals`` gets what
    :func:`_replay` returns."""
    numels = calls.numels
    backward = [(module, not entering) for module, entering in reversed(calls.events)]
    events = [*calls.events, *backward]  # (module, starts)
    trace = [module for module, starts in events if starts]
    # Elements walked from the start of the trace to each of its modules.
    walked = [0, *itertools.accumulate(sum(numels[p] for p in calls.modules[m]) for m in trace)]
    uses: dict[int, list[int]] = {}
    for step, module in enumerate(trace):
        for param in calls.modules[module]:
            uses.setdefault(param, []).append(step)
    queue = deque(
        (param, step)
        for step, module in enumerate(trace)
        for param in sorted(set(calls.modules[module]))
    )
    kept = persistent(calls, param_threshold, model_threshold)
    gathered: set[int] = set()
    fetched: list[int] = []  # every all-gather, in order
    active = [0] * len(numels)
    seen = [-(10**18)] * len(numels)  # the latest use the prefetcher has walked past
    held = n_available = step = 0

    def gather(params: set[int]) -> None:
        nonlocal held, n_available
        for param in params - gathered - kept:
            gathered.add(param)
            held += numels[param]
            n_available += numels[param]
            fetched.append(param)

    def reused(param: int, at: int) -> bool:
        later = uses[param]
        first = bisect.bisect_left(later, at)
        return first < len(later) and walked[later[first]] - walked[at] < reuse_distance

    def start(module: int) -> None:
        nonlocal step
        params = set(calls.modules[module])
        gather(params)
        for param in params:
            active[param] += 1
        due = {p for p in params if seen[p] < step}
        popped = 0
        while queue and popped < len(due):
            param, at = queue.popleft()
            seen[param] = at
            popped += 1
        if prefetch_bucket > 0:
            limit = min(max_live - n_available, prefetch_bucket)
            ahead: set[int] = set()
            numel = 0
            while queue and numel < limit:
                param, at = queue.popleft()
                seen[param] = max(seen[param], at)
                if param not in gathered and param not in kept and param not in ahead:
                    ahead.add(param)
                    numel += numels[param]
            gather(ahead)
        step += 1

    def end(module: int) -> None:
        nonlocal held, n_available
        for param in set(calls.modules[module]):
            active[param] -= 1
            if param in kept or seen[param] > step or reused(param, step):
                continue
            if active[param] == 0 and param in gathered:
                gathered.discard(param)
                held -= numels[param]
                n_available -= numels[param]

    always = sum(numels[p] for p in kept)
    after_forward = peak = 0
    first_done = False
    for number, (module, starts) in enumerate(events):
        if number == len(calls.events):
            after_forward = peak = held
        if starts:
            start(module)
        else:
            if number >= len(calls.events) and calls.modules[module]:
                first_done = True  # backward's first module with parameters is done
            end(module)
        if number >= len(calls.events) and not first_done:
            peak = max(peak, held)
    totals[:] = [after_forward + always, peak + always, *fetched]
