"""The collective-order checker: the tool for "ZeRO-3 hangs".

Every collective in :mod:`lightning_zero.comm` must be called by all ranks in the same order with
the same shapes. When one rank takes a data-dependent branch the others skip (under stage 3 the
skipped submodule's forward is an all-gather), the ranks wait in different collectives and the job
hangs until the collective timeout, or gloo pairs up unrelated calls and fails with a size error.

With ``ZeroStrategy(debug_collectives=True)`` or ``LIGHTNING_ZERO_DEBUG_COLLECTIVES=1`` the strategy
hands the engine a :class:`~lightning_zero.comm.CheckedGroup` instead of its plain process group.
Before each collective on it, every rank describes the call it is about to make (operation, module
being gathered, shapes, dtypes) and the descriptions are exchanged over a separate gloo group made
once for the purpose. If they differ, every rank raises a ``RuntimeError`` listing each rank's call,
so the branch is found at its first collective instead of as a hang::

    collective #66 differs between ranks:
      rank 0: all_gather for 'head' (backward) [(166,) float32 <- (83,) float32]
      rank 1: all_gather for 'extra' (forward) [(226,) float32 <- (113,) float32]

Costs one small object exchange per collective: for debugging, not for training runs.

Without it, stage 3 on CPU (a gloo group) still checks its own gathers cheaply
(:class:`GatherOrderCheck`, once per hook that starts gathers): a rank-dependent branch is an error naming the module within a collective,
not gloo's "Connection reset by peer" after the other rank aborted on a size mismatch. A rank that
waits in a collective outside lightning_zero (Lightning's own ``all_reduce`` of a logged metric,
say) while another waits in the checker still hangs until the collective timeout.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta

import torch
from torch.autograd.profiler import record_function

from lightning_zero import comm

#: Environment variable that turns the checker on for every ZeroStrategy that does not say otherwise.
ENV_VAR = "LIGHTNING_ZERO_DEBUG_COLLECTIVES"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def debug_from_env() -> bool:
    """The value of :data:`ENV_VAR` ("1"/"true"/"yes"/"on" or "0"/"false"/"no"/"off"/unset).

    Raises:
        ValueError: for any other value (a typo should not silently leave the checker off).
    """
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not a switch; set it to 1 (check collectives) or 0.")
    return value in _TRUE


def describe(op: str, tensors: tuple[torch.Tensor, ...], label: str = "") -> str:
    """One line naming a collective call: ``op``, what it is for, and its tensors' shapes and dtypes
    (outputs first, ``<-`` before the inputs of an all-gather or reduce-scatter)."""
    shapes = [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors]
    arrow = " <- ".join(shapes) if op in ("all_gather", "reduce_scatter") else ", ".join(shapes)
    where = f" for {label}" if label else ""
    return f"{op}{where} [{arrow}]"


class CollectiveChecker:
    """Compares, across ranks, each collective before it is issued.

    Args:
        group: a gloo group over the same ranks as the checked group, used only for the exchange
            (a gloo group because descriptions are Python objects, and so that NCCL streams are
            not involved).
    """

    def __init__(self, group: comm.ProcessGroup) -> None:
        self.group = group
        self.count = 0  # collectives checked so far: the same on every rank until a mismatch

    def check(self, op: str, tensors: tuple[torch.Tensor, ...], label: str = "") -> None:
        """Raise on every rank if the ranks are not all about to make the same call. Call on all ranks."""
        self.count += 1
        call = describe(op, tensors, label)
        with record_function("lightning_zero::check_collective"):
            calls = comm.all_gather_object(call, self.group)
        if any(other != calls[0] for other in calls):
            listing = "\n".join(f"  rank {r}: {c}" for r, c in enumerate(calls))
            raise RuntimeError(
                f"collective #{self.count} differs between ranks:\n{listing}\n"
                "Without debug_collectives this would hang or fail with an unrelated size error. Every rank "
                "must run the same modules in the same order: under stage 3 a branch that depends on a rank's "
                "data (an `if` on a batch value, an early exit, a module skipped on some ranks) must be taken "
                "by all ranks, e.g. decide it from values all-reduced across ranks, or run the module anyway "
                "and discard its output."
            )


def checked_group(group: comm.ProcessGroup, timeout: timedelta | None) -> comm.CheckedGroup:
    """``group`` with a :class:`CollectiveChecker` attached; makes the checker's gloo group. Call on
    all ranks, once per strategy (making a group is itself a collective)."""
    if isinstance(group, comm.CheckedGroup):
        return group  # already checked: one checker per group
    return comm.CheckedGroup(group, CollectiveChecker(comm.new_gloo_group(group, timeout)))


class GatherOrderCheck:
    """Stage 3's default check that every rank is about to gather the same flat buffers: before the
    parameter all-gathers that one hook starts, one all-gather of a few integers naming them, on a
    side gloo group over the same ranks (:func:`lightning_zero.comm.side_gloo_group`), so that it never
    waits behind the gathers in flight. A module's own gathers wait for their check; the prefetches a
    hook decides are checked without waiting (:meth:`start`) and start at the next hook, once verified.
    Only where the data group is gloo (CPU training): there the exchange costs microseconds next to
    the gathers, and a mismatched gather aborts the process from gloo's thread, beyond any Python
    error. On NCCL groups ``debug_collectives`` does it (a check there would synchronize the host
    with the device at every gather).

    Args:
        group: the group the check runs on (the side group of a plain gloo data group).
        describe: buffer number -> what it holds, for the error message.
    """

    #: buffer numbers listed by name in the error message (the rest are compared through a hash)
    LISTED = 6

    def __init__(self, group: comm.ProcessGroup, describe: Callable[[int], str]) -> None:
        self.group = group
        self.describe = describe

    def __getstate__(self) -> dict[str, object]:
        # A deep-copied or pickled model (an averaged copy, a saved trainer) carries no process group.
        return {**self.__dict__, "group": None}

    def _encode(self, codes: list[int]) -> list[int]:
        digest = len(codes)
        for code in codes:  # a polynomial hash, the same on every rank (Python's hash() is per process)
            digest = (digest * 1_000_003 + code + 1) % (1 << 61)
        listed = codes[: self.LISTED]
        return [len(codes), *listed, *([-1] * (self.LISTED - len(listed))), digest]

    def _name(self, row: list[int]) -> str:
        count, listed = row[0], [c for c in row[1 : 1 + self.LISTED] if c >= 0]
        if count == 0:
            return "nothing"
        more = f" and {count - len(listed)} more buffer(s)" if count > len(listed) else ""
        return "; ".join(self.describe(c) for c in listed) + more

    def start(self, codes: list[int], label: str) -> PendingCheck:
        """Begin the exchange of the buffer numbers ``codes`` (in order); :meth:`PendingCheck.verify`
        completes it. No parameter all-gather may start on any rank before its check is verified.
        Call on all ranks, in the same order."""
        mine = torch.tensor(self._encode(codes), dtype=torch.int64)
        every = torch.empty(comm.world_size(self.group) * mine.numel(), dtype=torch.int64)
        handle = comm.all_gather(every, mine, self.group, async_op=True, label="stage 3 gather order")
        return PendingCheck(self, handle, every, label)

    def agree(self, codes: list[int], label: str) -> None:
        """Raise on every rank unless all ranks pass the same buffer numbers ``codes`` (in order).
        Call on all ranks."""
        self.start(codes, label).verify()

    def _raise_unless_equal(self, every: torch.Tensor, label: str) -> None:
        rows = every.view(comm.world_size(self.group), -1).tolist()
        if any(row != rows[0] for row in rows):
            listing = "\n".join(f"  rank {r}: {self._name(row)}" for r, row in enumerate(rows))
            raise RuntimeError(
                f"the ranks are about to gather different parameters under ZeRO stage 3 (this rank: {label}):\n"
                f"{listing}\nEvery rank must run the same modules in the same order: a branch that depends on "
                "a rank's data (an `if` on a batch value or on the rank, an early exit, a module skipped on some "
                "ranks) must be taken by all ranks, e.g. decide it from values all-reduced across ranks, or run "
                "the module anyway and discard its output."
            )


class PendingCheck:
    """A :class:`GatherOrderCheck` exchange in flight (the prefetches a hook decided: their gathers
    start once it is verified, at the next hook, by when it has long arrived)."""

    def __init__(self, check: GatherOrderCheck, handle: comm.Handle, every: torch.Tensor, label: str) -> None:
        self.check, self.handle, self.every, self.label = check, handle, every, label

    def verify(self) -> None:
        """Wait for the exchange; raise on every rank unless all ranks sent the same numbers."""
        self.handle.wait()
        self.check._raise_unless_equal(self.every, self.label)
