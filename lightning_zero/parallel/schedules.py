"""Pipeline schedules as pure data: the order in which one stage runs forwards and backwards.

A schedule is a list of :class:`Action` (``F``: forward of micro-batch ``i``, ``B``: its backward)
for one stage; no communication happens here, so the order can be unit-tested on its own and the
runtime (:mod:`lightning_zero.parallel.pipeline`) only walks the list.

1F1B (PipeDream-Flush, the schedule of Megatron-LM and DeepSpeed): stage ``s`` of ``P`` first runs
``P - 1 - s`` forwards (warm-up), then alternates one forward and one backward (steady state), then
runs the remaining backwards (cool-down). At most ``P - s`` micro-batches are in flight on stage
``s`` (forwarded, not yet backwarded), so activation memory is bounded by the number of stages, not
by the number of micro-batches ``m`` as in GPipe (all forwards, then all backwards). Both have the
same bubble: ``(P - 1) / (m + P - 1)`` of each stage's time idle when forward and backward of a
micro-batch take the same time on every stage (:func:`bubble_fraction`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Action:
    """``kind`` "F" (forward) or "B" (backward) of micro-batch ``micro_batch``."""

    kind: Literal["F", "B"]
    micro_batch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def _check(stage: int, stages: int, micro_batches: int) -> None:
    if stages < 1 or not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside a pipeline of {stages} stages")
    if micro_batches < 1:
        raise ValueError(f"a pipeline schedule needs at least 1 micro-batch, got {micro_batches}")


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """The 1F1B order of ``stage`` (0-based) in a pipeline of ``stages`` with ``micro_batches``."""
    _check(stage, stages, micro_batches)
    warmup = min(stages - 1 - stage, micro_batches)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    actions += [Action("B", i) for i in range(micro_batches - warmup, micro_batches)]
    return actions


def gpipe(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """All forwards, then all backwards (in the same order)."""
    _check(stage, stages, micro_batches)
    return [Action("F", i) for i in range(micro_batches)] + [Action("B", i) for i in range(micro_batches)]


def forward_only(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """Evaluation: forwards only."""
    _check(stage, stages, micro_batches)
    return [Action("F", i) for i in range(micro_batches)]


def schedule(name: str, stage: int, stages: int, micro_batches: int) -> list[Action]:
    """The actions of ``stage`` under the schedule called ``name`` (one of :data:`SCHEDULES`)."""
    if name == "1f1b":
        return one_f_one_b(stage, stages, micro_batches)
    if name == "gpipe":
        return gpipe(stage, stages, micro_batches)
    raise ValueError(f"unknown pipeline schedule {name!r}; use one of {SCHEDULES}")


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batches forwarded and not yet backwarded at any point of ``actions``."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle fraction of 1F1B and GPipe with equal stage times: ``(P - 1) / (m + P - 1)``."""
    return (stages - 1) / (micro_batches + stages - 1)
