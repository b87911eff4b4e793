"""The agreements of a save: every rank's outcome of one step, exchanged, so that a failure on one
rank raises on every rank instead of leaving the others waiting in the next collective
(:mod:`~lightning_zero.checkpoint.save`, :mod:`~lightning_zero.checkpoint.commit`,
:mod:`~lightning_zero.checkpoint.full`)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from lightning_zero import comm


def agree(outcome: tuple[bool, Any], group: comm.ProcessGroup, what: str) -> list:
    """Exchange every rank's ``(ok, value or traceback)``; return the values, or raise on every rank
    if any rank failed. Call on all ranks."""
    outcomes = comm.all_gather_object(outcome, group)
    failed = [(r, value) for r, (ok, value) in enumerate(outcomes) if not ok]
    if failed:
        rank, message = failed[0]
        raise RuntimeError(f"{what} failed on rank {rank} (of {len(outcomes)}):\n{message}")
    return [value for _, value in outcomes]


def guarded(fn: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, fn())``, or ``(False, traceback)`` when it raised (for :func:`agree`)."""
    try:
        return True, fn()
    except Exception:  # noqa: BLE001 - reported to every rank by agree
        return False, traceback.format_exc()
