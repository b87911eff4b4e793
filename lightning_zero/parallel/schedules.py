"""Pipeline schedules as pure data: the order in which one stage runs forwards and backwards.

A schedule is a list of :class:`Action` (``F``: forward of micro-batch ``i`` through model chunk
``c``, ``B``: its backward) for one stage; no communication happens here, so the order can be
unit-tested on its own (:func:`simulate` plays every stage's list against the others) and the
runtime (:mod:`lightning_zero.parallel.runner`) only walks the list.

1F1B (PipeDream-Flush, the schedule of Megatron-LM and DeepSpeed): stage ``s`` of ``P`` first runs
``P - 1 - s`` forwards (warm-up), then alternates one forward and one backward (steady state), then
runs the remaining backwards (cool-down). At most ``P - s`` micro-batches are in flight on stage
``s`` (forwarded, not yet backwarded), so activation memory is bounded by the number of stages, not
by the number of micro-batches ``m`` as in GPipe (all forwards, then all backwards). Both have the
same bubble: ``(P - 1) / (m + P - 1)`` of each stage's time idle when forward and backward of a
micro-batch take the same time on every stage (:func:`bubble_fraction`).

Interleaved 1F1B (Megatron-LM, arXiv 2104.04473 §2.2): each stage holds ``v`` chunks of layers,
virtual stage ``k = c * P + s`` being chunk ``c`` of stage ``s``, so a micro-batch passes every
stage ``v`` times. Micro-batches go in groups of ``P`` (``m`` must be a multiple of ``P``): chunk 0
of a group, then chunk 1, ...; the warm-up is ``2 (P - s - 1) + (v - 1) P`` forwards. The bubble
shrinks to ``(P - 1) / (v m + P - 1)`` at the price of ``v`` times the messages.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from lightning_zero.parallel_config import PIPELINE_SCHEDULES as SCHEDULES


@dataclass(frozen=True)
class Action:
    """``kind`` "F" (forward) or "B" (backward) of micro-batch ``micro_batch`` through this stage's
    model chunk ``chunk`` (always 0 without interleaving)."""

    kind: Literal["F", "B"]
    micro_batch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


def _check(stage: int, stages: int, micro_batches: int, chunks: int = 1) -> None:
    if stages < 1 or not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside a pipeline of {stages} stages")
    if micro_batches < 1:
        raise ValueError(f"a pipeline schedule needs at least 1 micro-batch, got {micro_batches}")
    if chunks < 1:
        raise ValueError(f"pipeline_chunks={chunks} must be at least 1")


def interleavable(stages: int, micro_batches: int) -> bool:
    """Whether interleaved 1F1B can run ``micro_batches``: it takes them in groups of ``stages``."""
    return micro_batches % stages == 0


def _check_interleaved(stages: int, micro_batches: int, chunks: int) -> None:
    if chunks > 1 and not interleavable(stages, micro_batches):
        raise ValueError(
            f"the interleaved schedule (pipeline_chunks={chunks}) runs micro-batches in groups of the {stages} "
            f"stages, but there are {micro_batches}; use a multiple of {stages} micro-batches (and a batch of at "
            "least that many rows)"
        )


def _interleaved_order(stages: int, micro_batches: int, chunks: int, forward: bool) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of the k-th forward (or backward) on every stage: groups of P micro-batches
    through chunk 0, 1, ... (backward: v-1, ..., 0)."""
    order = []
    for k in range(micro_batches * chunks):
        group, within = divmod(k, stages * chunks)
        chunk = within // stages
        order.append((group * stages + k % stages, chunk if forward else chunks - 1 - chunk))
    return order


def one_f_one_b(stage: int, stages: int, micro_batches: int, chunks: int = 1) -> list[Action]:
    """The 1F1B order of ``stage`` (0-based) in a pipeline of ``stages`` with ``micro_batches``;
    interleaved over ``chunks`` model chunks per stage when ``chunks > 1``."""
    _check(stage, stages, micro_batches, chunks)
    _check_interleaved(stages, micro_batches, chunks)
    forwards = [Action("F", i, c) for i, c in _interleaved_order(stages, micro_batches, chunks, True)]
    backwards = [Action("B", i, c) for i, c in _interleaved_order(stages, micro_batches, chunks, False)]
    total = len(forwards)
    if chunks == 1:
        warmup = min(stages - 1 - stage, total)
    elif micro_batches == stages:
        warmup = total  # one group: every forward first (as Megatron-LM)
    else:
        warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
    actions = forwards[:warmup]
    for k in range(total - warmup):
        actions += [forwards[warmup + k], backwards[k]]
    return actions + backwards[total - warmup :]


def gpipe(stage: int, stages: int, micro_batches: int, chunks: int = 1) -> list[Action]:
    """All forwards (every micro-batch through chunk 0, then chunk 1, ...), then all backwards
    (last chunk first). Any number of micro-batches."""
    _check(stage, stages, micro_batches, chunks)
    return forward_only(stage, stages, micro_batches, chunks) + [
        Action("B", i, c) for c in reversed(range(chunks)) for i in range(micro_batches)
    ]


def forward_only(stage: int, stages: int, micro_batches: int, chunks: int = 1) -> list[Action]:
    """Evaluation: forwards only, every micro-batch through chunk 0, then chunk 1, ... (any number
    of micro-batches: nothing waits on a backward)."""
    _check(stage, stages, micro_batches, chunks)
    return [Action("F", i, c) for c in range(chunks) for i in range(micro_batches)]


def schedule(name: str, stage: int, stages: int, micro_batches: int, chunks: int = 1) -> list[Action]:
    """The actions of ``stage`` under the schedule called ``name`` (one of :data:`SCHEDULES`)."""
    if name == "1f1b":
        return one_f_one_b(stage, stages, micro_batches, chunks)
    if name == "gpipe":
        return gpipe(stage, stages, micro_batches, chunks)
    raise ValueError(f"unknown pipeline schedule {name!r}; use one of {SCHEDULES}")


def max_in_flight(actions: list[Action]) -> int:
    """Most (micro-batch, chunk) forwards not yet backwarded at any point of ``actions``."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The idle fraction with equal stage times: ``(P - 1) / (v m + P - 1)`` (v = 1: 1F1B, GPipe)."""
    return (stages - 1) / (chunks * micro_batches + stages - 1)


def simulate(schedules: list[list[Action]], chunks: int = 1, train: bool = True) -> None:
    """Play every stage's actions against the others, as the runner does (sends never wait, a
    receive waits for its message, messages of one kind between two stages arrive in order).
    Raises ``RuntimeError`` on a deadlock or when a stage would receive another micro-batch's
    message than the one it needs; returns when every action ran. Pure: no processes."""
    stages = len(schedules)
    last = stages * chunks - 1
    channels: dict[tuple[int, int, str], deque] = {}
    position = [0] * stages

    def needs(stage: int, action: Action) -> tuple[tuple[int, int, str], tuple[int, int]] | None:
        k = action.chunk * stages + stage  # virtual stage
        if action.kind == "F" and k > 0:
            return ((k - 1) % stages, stage, "activation"), (action.micro_batch, k - 1)
        if action.kind == "B" and k < last:
            return ((k + 1) % stages, stage, "gradient"), (action.micro_batch, k + 1)
        return None

    while any(position[s] < len(schedules[s]) for s in range(stages)):
        progressed = False
        for stage in range(stages):
            if position[stage] == len(schedules[stage]):
                continue
            action = schedules[stage][position[stage]]
            need = needs(stage, action)
            if need is not None:
                queue = channels.get(need[0])
                if not queue:
                    continue  # blocked in a receive
                if queue[0] != need[1]:
                    raise RuntimeError(f"stage {stage} at {action!r} would receive {queue[0]} instead of {need[1]}")
                queue.popleft()
            k = action.chunk * stages + stage
            if action.kind == "F" and k < last:
                channels.setdefault((stage, (k + 1) % stages, "activation"), deque()).append((action.micro_batch, k))
            if action.kind == "B" and k > 0:
                channels.setdefault((stage, (k - 1) % stages, "gradient"), deque()).append((action.micro_batch, k))
            position[stage] += 1
            progressed = True
        if not progressed:
            stuck = {s: schedules[s][position[s]] for s in range(stages) if position[s] < len(schedules[s])}
            raise RuntimeError(f"deadlock: every unfinished stage waits in a receive: {stuck}")
