"""Stage 3 under Fabric: a forward that only some ranks run is an error that names it, not a hang.

Programs written for DDP often do something on rank 0 alone while the others wait at a barrier:

    if fabric.global_rank == 0:
        sample = generate(model, prompt)     # LitGPT's LoRA script, "export an example", ...
    fabric.barrier()

Under DDP that is fine: a forward needs no other rank. Under ZeRO stage 3 (and FSDP) every forward
all-gathers the sharded parameters, a collective every rank must join; rank 0 waits in its first
all-gather while the others wait in the barrier, and the job hangs until the collective timeout
(10 minutes by default). Fabric's ZeroStrategy watches for it through the rendezvous store:

* each model forward outside ``gathered_parameters`` counts itself under this rank's key before
  it starts (one store round trip), and checks whether another rank has already entered a barrier
  this rank has not reached (one more): then this forward is one the others will not join, and it
  raises at once, naming the model;
* ``fabric.barrier()`` is a barrier through the store (no collective on the process group), and
  while it waits it compares the other ranks' forward counts with this rank's: a rank that started
  a forward this rank did not run is in a collective this rank will never join, so the barrier
  raises, naming that rank and the model, within a poll interval (10 ms).

Either way the raising rank's exit ends the other's wait (its peer is gone), instead of a hang. The
cost is two store round trips per forward of the whole model (not per module) and a polling barrier;
models whose parameters are all kept whole (``param_persistence_threshold``) gather nothing and are
not watched. Run the rank-0 action on every rank instead (and use its result on rank 0), or inside
``with fabric.strategy.gathered_parameters(model):`` entered by every rank (then the forward gathers
nothing), or consolidate a checkpoint and run the action in a separate process.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

_BARRIERS = "lightning_zero/lockstep/{}/barriers"
_FORWARDS = "lightning_zero/lockstep/{}/forwards/{}"
_POLL_S = 0.01


class Lockstep:
    """The forward and barrier bookkeeping of one Fabric run (see the module docstring).

    Args:
        store: the rendezvous store of the default process group.
        rank, world_size: this process's place in it.
        timeout: longest wait in :meth:`barrier` (the collective timeout).
        run: a name unique to this strategy instance among those sharing the store (keys are never reused).
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout: timedelta, run: str) -> None:
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        self._run = run
        self.forwards = 0  # forwards this rank started
        self.barriers = 0  # barriers this rank entered
        self.paused = 0  # > 0 inside gathered_parameters: a forward there gathers nothing

    def _key(self, rank: int) -> str:
        return _FORWARDS.format(self._run, rank)

    def before_forward(self, name: str) -> None:
        """Count this forward; raise if another rank waits at a barrier this rank has not reached."""
        if self.paused:
            return
        self.forwards += 1
        self.store.add(self._key(self.rank), 1)
        entered = int(self.store.add(_BARRIERS.format(self._run), 0))
        if entered > self.barriers * self.world_size:
            raise RuntimeError(
                f"rank {self.rank} starts a forward of {name} under ZeRO stage 3 while another rank waits at "
                f"fabric.barrier() ({entered - self.barriers * self.world_size} rank(s) entered barrier "
                f"#{self.barriers + 1}): every stage-3 forward all-gathers the sharded parameters, a collective "
                "all ranks must join, so this would hang. Run it on every rank (use the result on rank 0), or "
                "inside `with fabric.strategy.gathered_parameters(model):` entered by every rank."
            )

    def barrier(self, name: str) -> None:
        """``fabric.barrier()`` through the store, watching the other ranks' forwards while it waits."""
        self.barriers += 1
        self.store.add(_BARRIERS.format(self._run), 1)
        deadline = time.monotonic() + self.timeout.total_seconds()
        others = [r for r in range(self.world_size) if r != self.rank]
        while True:
            if int(self.store.add(_BARRIERS.format(self._run), 0)) >= self.barriers * self.world_size:
                return
            for rank in others:
                if int(self.store.add(self._key(rank), 0)) > self.forwards:
                    raise RuntimeError(
                        f"rank {rank} runs a forward of {name} under ZeRO stage 3 that rank {self.rank} does not "
                        f"run (rank {self.rank} waits at fabric.barrier() #{self.barriers}): every stage-3 forward "
                        "all-gathers the sharded parameters, a collective all ranks must join, so the run would "
                        "hang. Run it on every rank (use the result on rank 0), or inside `with "
                        "fabric.strategy.gathered_parameters(model):` entered by every rank."
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"fabric.barrier() #{self.barriers} timed out after {self.timeout} on rank {self.rank}."
                )
            time.sleep(_POLL_S)
