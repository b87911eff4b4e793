"""When stage 3's gathers start ahead of use (a mixin of
:class:`~lightning_zero.zero.gather.GatherCoordinator`): the prefetch window along the previous
pass's recorded module order, the buffers kept gathered because that order reuses them soon, the
order check of prefetches sent at one hook and completed at the next, and the parameter disk tier's
reads started ahead of the gathers. The coordinator records the order and decides when the plan
still holds (``_on_plan``); this mixin only reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_zero import comm
from lightning_zero.config import ZeroConfig
from lightning_zero.debug import GatherOrderCheck, PendingCheck
from lightning_zero.zero.flat import FlatBuffer, ParamState

if TYPE_CHECKING:
    from lightning_zero.zero.swap import ParamTier


class GatherPrefetch:
    """The prefetch plan of :class:`~lightning_zero.zero.gather.GatherCoordinator` (see the module docstring)."""

    config: ZeroConfig
    group: comm.ProcessGroup
    shard_tier: ParamTier | None
    _all: list[FlatBuffer]
    _number: dict[int, int]
    _order: GatherOrderCheck | None
    _pending: tuple[PendingCheck, list[FlatBuffer], str] | None
    names: list[str]
    needs: list[list[FlatBuffer]]
    trace: list[int]
    previous: list[int]
    _on_plan: bool

    def _start_checked_later(self, buffers: list[FlatBuffer], label: str) -> None:
        """Prefetches: on gloo their order check is sent now and their gathers start at the next
        hook (:meth:`_flush`), so that no rank waits here for the others; elsewhere they start now.
        (Started a hook after they were chosen, past the releases in between, the sizes they take
        from the pool are not those just given back: :meth:`BlockPool.take
        <lightning_zero.zero.pools.BlockPool.take>` gives each size its own blocks for that.)"""
        self._flush()
        if not buffers:
            return
        if self._order is None:
            for b in buffers:
                b.gather_start(self.group, label)
            return
        self._pending = (self._order.start([self._number[id(b)] for b in buffers], label), buffers, label)

    def _flush(self, start: bool = True) -> None:
        """Complete the pending prefetches' order check and (``start``) start their gathers. Call on all ranks."""
        if self._pending is None:
            return
        check, buffers, label = self._pending
        self._pending = None
        check.verify()
        if start:
            for b in buffers:
                b.gather_start(self.group, label)

    def _live_numel(self) -> int:
        return sum(b.numel for b in self._all if b.state is not ParamState.RELEASED)

    def _prefetch(self, upcoming: list[int]) -> None:
        """Start (:meth:`_start_checked_later`) the gathers of the next modules' buffers, up to the window."""
        self._flush()  # the last hook's: started first, so that the window counts them in flight
        if upcoming:
            self._start_checked_later(self._window(upcoming), f"{self.names[upcoming[0]]} (prefetch)")

    def _window(self, upcoming: list[int]) -> list[FlatBuffer]:
        """The released buffers that the modules ``upcoming`` need, in order, that fit the window."""
        budget = self.config.prefetch_bucket_numel
        live = self._live_numel()
        chosen: list[FlatBuffer] = []
        seen: set[int] = set()
        for index in upcoming:
            for b in self.needs[index]:
                if id(b) in seen:
                    continue
                seen.add(id(b))
                if b.state is not ParamState.RELEASED:
                    # gathered or on its way already (an earlier prefetch): part of the window ahead.
                    # Not counting it let every module's backward prefetch a further window, until
                    # the whole model was gathered (measured on the benchmark GPT: 54 MiB of gathers
                    # alive at once in backward, the model's full fp32 size, with a 5M window).
                    budget -= b.numel
                    if budget < 0:
                        return chosen
                    continue
                if self.shard_tier is not None and b.shard_tier is not None and not self.shard_tier.ready(b):
                    # its shard's read was not started at an earlier hook (ParamTier.ready: a decision
                    # that gates a collective, so the same on every rank, not "has my read finished")
                    return chosen
                if budget - b.numel < 0 or live + b.numel > self.config.max_live_parameters:
                    return chosen
                chosen.append(b)
                budget -= b.numel
                live += b.numel
        return chosen

    def _reused_soon(self, index: int) -> bool:
        if not self._on_plan:
            return False
        window = 0
        for upcoming in self.previous[len(self.trace) :]:
            if upcoming == index:
                return True
            window += sum(b.numel for b in self.needs[upcoming])
            if window > self.config.prefetch_bucket_numel:
                return False
        return False

    def _read_ahead(self, upcoming: list[int]) -> None:
        """Start the disk reads of the next modules' shards (the parameter disk tier bounds how many)."""
        if self.shard_tier is not None:
            self.shard_tier.read_ahead([b for index in upcoming for b in self.needs[index]])
