"""The step time of a tensor- and pipeline-parallel plan (:mod:`.model_parallel`).

Each planned stage's recorded step is replayed on the machine (:func:`~.timing.step_time`) with
every collective costed on its own group's size: the tensor group's all-reduces on T ranks' ring, the
data group's on D, a pipeline message at its bytes. A receive blocks for its transfer, as the
runner's ``comm.recv`` does; the wait for the other stage is the schedule's, replayed here across the
stages: the planner marks each action of the runner's schedule in the trace (``("action", kind,
micro-batch, chunk)``), each action's events are replayed alone for its time, and
:func:`simulate` plays every stage's actions in the schedule's order, each starting when its stage is
free and its input is there (a forward after the previous virtual stage's forward of that micro-batch,
a backward after the next one's backward). The step ends when the last stage has finished its
actions and what follows them (the sends' completion, the loss broadcast, the optimizer step). Stages
planned once for several (equal layers) lend those their action times. Every group runs on the
machine's one interconnect.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_zero.parallel.schedules import schedule
from lightning_zero.plan.machine import Machine, ring_bytes
from lightning_zero.plan.timing import Event, StepTime, step_time

Action = tuple[str, int, int]
"""``(kind, micro-batch, chunk)``: "F" or "B" of one micro-batch through one of the stage's chunks."""


@dataclass(frozen=True)
class PipelineStepTime(StepTime):
    """A model-parallel step; the phase fields are of the busiest stage, ``seconds`` the whole step."""

    bubble: float = 0.0
    """Seconds the busiest stage idles in the step, waiting for the others (in ``seconds``)."""
    stage: int = 0
    """The busiest stage (the most seconds of work of its own)."""


def group_bytes(op: str, nbytes: int, size: int) -> int:
    """Bytes whose cost on 2 ranks is ``op``'s over a whole buffer of ``nbytes`` on ``size`` ranks."""
    per_rank = ring_bytes(op, 1, 2)
    return round(ring_bytes(op, nbytes, size) / per_rank) if per_rank else 0


def _calls(p: Any) -> list[tuple[str, int]]:
    sizes = p.parallel.group_sizes
    return [
        (op, group_bytes(op, nbytes, sizes.get(group, 2)))
        for (op, nbytes), group in zip(p.step_calls, p.parallel.call_groups, strict=True)
    ]


def _split(trace: Sequence[Event]) -> tuple[dict[Action, list[Event]], list[Event]]:
    """The events of each action (what precedes the first goes with it), and the tail: from the
    planner's "backward" phase marker after the last action (the schedule has returned) to the end."""
    marks = [i for i, event in enumerate(trace) if event[0] == "action"]
    if not marks:
        return {}, list(trace)
    # each action's own marker pair is ("phase", ...), ("action", ...): the next "backward" phase
    # after the last action marker is the one the planner adds once the schedule has run
    after = (i for i in range(marks[-1] + 1, len(trace)) if trace[i] == ("phase", "backward"))
    tail = next(after, len(trace))
    bounds = [*marks, tail]
    actions = {
        (trace[i][1], trace[i][2], trace[i][3]): [e for e in trace[(i if n else 0) : bounds[n + 1]] if e[0] != "action"]
        for n, i in enumerate(marks)
    }
    return actions, list(trace[tail:])


def simulate(
    durations: Sequence[dict[Action, float]], tails: Sequence[float], name: str, micro_batches: int, chunks: int
) -> list[float]:
    """When each stage finishes its step: every stage runs its actions of the ``name`` schedule in
    order, each starting once the stage is free and its input has arrived (a forward of virtual stage
    k after the forward of k - 1, a backward after the backward of k + 1, of the same micro-batch),
    taking ``durations[stage][action]`` seconds; then ``tails[stage]``. Pure."""
    stages = len(durations)
    last = stages * chunks - 1
    orders = [schedule(name, s, stages, micro_batches, chunks) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    free, position = [0.0] * stages, [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                action = orders[s][position[s]]
                k = action.chunk * stages + s
                need = None
                if action.kind == "F" and k > 0:
                    need = ("F", action.micro_batch, k - 1)
                elif action.kind == "B" and k < last:
                    need = ("B", action.micro_batch, k + 1)
                if need is not None and need not in done:
                    break  # waiting for the other stage
                start = max(free[s], done.get(need, 0.0) if need else 0.0)
                free[s] = start + durations[s][(action.kind, action.micro_batch, action.chunk)]
                done[(action.kind, action.micro_batch, k)] = free[s]
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the {name} schedule deadlocks in the replay at {position}")
    return [free[s] + tails[s] for s in range(stages)]


def parallel_step_time(p: Any, machine: Machine, fresh_above: float = math.inf) -> PipelineStepTime:
    """The step of a D x T x P layout on ``machine`` (see the module's docstring); ``fresh_above``:
    :func:`~.timing.fresh_threshold` of the plan."""
    info = p.parallel
    plans = info.stages or (p,)
    whole = [(step_time(q.trace, _calls(q), 2, machine, fresh_above), q) for q in plans]
    if info.pipeline == 1 or not info.stages:
        slowest, q = max(whole, key=lambda t: t[0].seconds)
        fields = {f.name: getattr(slowest, f.name) for f in dataclasses.fields(StepTime)}
        return PipelineStepTime(**fields, stage=q.parallel.stage)
    durations: list[dict[Action, float]] = [{} for _ in range(info.pipeline)]
    tails = [0.0] * info.pipeline
    for q in plans:
        calls = _calls(q)
        actions, tail = _split(q.trace)
        seconds = {a: step_time(events, calls, 2, machine, fresh_above).seconds for a, events in actions.items()}
        for s in q.parallel.represents:
            durations[s], tails[s] = seconds, step_time(tail, calls, 2, machine, fresh_above).seconds
    ends = simulate(durations, tails, info.schedule, info.micro_batches, info.chunks)
    busy = [sum(durations[s].values()) + tails[s] for s in range(info.pipeline)]
    stage = max(range(info.pipeline), key=lambda s: busy[s])
    representative = next(t for t, q in whole if stage in q.parallel.represents)
    fields = {f.name: getattr(representative, f.name) for f in dataclasses.fields(StepTime)}
    fields["seconds"] = max(ends)
    return PipelineStepTime(**fields, bubble=max(ends) - busy[stage], stage=stage)
