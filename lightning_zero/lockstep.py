"""Stage 3: a forward that only some ranks run is an error that names it, not a hang (Fabric and Trainer).

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

import itertools
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
                    if int(self.store.add(_BARRIERS.format(self._run), 0)) >= self.barriers * self.world_size:
                        return  # the barrier completed meanwhile: that forward came after it
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


_STEPS = "lightning_zero/steplock/{}/steps"
_UNSCOPED = "lightning_zero/steplock/{}/unscoped"
_TRAINER_BARRIERS = "lightning_zero/steplock/{}/barriers"
_UNSCOPED_WAIT_S = 30.0
_TRAINER_RUNS = itertools.count()  # Trainer stage-3 engines of this process: the same sequence on every rank


class StepLockstep:
    """The same watch for the Trainer's stage 3, where the strategy drives every step.

    A forward outside the Trainer's steps (a callback's ``pl_module(x)`` under ``if
    trainer.is_global_zero``, a hook that runs the model) all-gathers parameters; if only some ranks
    run it, the others go on into their next step (whose all-gathers pair up with it, or hang) or
    wait in ``strategy.barrier()``. Counted through the store:

    * the outermost forward outside a step that has parameters to gather counts itself, then waits
      until every rank has counted as many (every rank runs it: go on), raising, naming the module,
      as soon as another rank has started a step or entered a barrier this rank has not;
    * every step start counts itself (one store round trip) and raises if another rank is already
      in such a forward that this rank has not run (a second round trip);
    * every ``strategy.barrier()`` counts itself before it waits.

    Whichever rank sees it first raises; its exit ends the other ranks' waits. A rank that went on
    into a collective the store does not see (Lightning broadcasts a flag at the start of every
    training batch) cannot say so: the forward then raises after 30 s without the other ranks (or
    the collective timeout, if shorter). A forward every rank runs costs one wait for the slowest
    rank; so a forward that the ranks reach more than 30 s apart must run inside
    ``gathered_parameters`` (which is not watched); a step costs two store round trips.

    Args:
        store, rank, world_size, timeout: as for :class:`Lockstep`.
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> None:
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, timeout
        run = next(_TRAINER_RUNS)
        self._steps_key, self._unscoped_key = _STEPS.format(run), _UNSCOPED.format(run)
        self._barriers_key = _TRAINER_BARRIERS.format(run)
        self.steps = self.unscoped = self.barriers = 0
        #: longest wait for the other ranks at a forward outside the steps
        self.wait_s = min(_UNSCOPED_WAIT_S, timeout.total_seconds())

    def __getstate__(self) -> dict[str, Any]:
        # A pickled or deep-copied trainer or model (an averaged copy) carries no store: the copy watches nothing.
        return {**self.__dict__, "store": None}

    def _total(self, key: str) -> int:
        return int(self.store.add(key, 0))

    def before_step(self) -> None:
        """A step starts on this rank; raise if another rank runs a forward outside the steps that
        this rank has not run."""
        if self.store is None:
            return
        self.steps += 1
        self.store.add(self._steps_key, 1)
        if self._total(self._unscoped_key) > self.unscoped * self.world_size:
            raise RuntimeError(
                f"rank {self.rank} starts a step under ZeRO stage 3 while another rank runs a forward outside "
                "the Trainer's steps that this rank does not run (a callback or hook that runs the model on some "
                f"ranks only, e.g. under `if trainer.is_global_zero`). {_ADVICE}"
            )

    def before_barrier(self) -> None:
        """``strategy.barrier()`` on this rank (counted before it waits)."""
        if self.store is None:
            return
        self.barriers += 1
        self.store.add(self._barriers_key, 1)

    def before_unscoped(self, name: str) -> None:
        """A forward of ``name`` outside the steps, with parameters to gather: wait for every rank to
        reach it, raising if another rank went on into a step or a barrier instead."""
        if self.store is None:
            return
        self.unscoped += 1
        self.store.add(self._unscoped_key, 1)
        deadline = time.monotonic() + self.wait_s
        while self._total(self._unscoped_key) < self.unscoped * self.world_size:
            steps, barriers = self._total(self._steps_key), self._total(self._barriers_key)
            if steps > self.steps * self.world_size or barriers > self.barriers * self.world_size:
                if self._total(self._unscoped_key) >= self.unscoped * self.world_size:
                    return  # every rank reached it meanwhile: the step or barrier came after it
                where = "its next step" if steps > self.steps * self.world_size else "strategy.barrier()"
                raise RuntimeError(
                    f"rank {self.rank} runs a forward of {name} under ZeRO stage 3 outside the Trainer's steps, "
                    f"and another rank does not: it went on into {where}. {_ADVICE}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank {self.rank} runs a forward of {name} under ZeRO stage 3 outside the Trainer's steps, and "
                    f"the other ranks did not reach it within {self.wait_s:.0f} s: they are probably in another "
                    f"collective (e.g. Lightning's broadcast at the start of the next batch). {_ADVICE}"
                )
            time.sleep(_POLL_S)


_ADVICE = (
    "Every stage-3 forward all-gathers the sharded parameters, a collective all ranks must join, so this would "
    "hang. Run it on every rank (use the result on rank 0), or inside `with "
    "trainer.strategy.gathered_parameters(pl_module):` entered by every rank."
)


def watch_trainer_steps(engine: Any, group: Any, timeout: timedelta) -> StepLockstep | None:
    """A :class:`StepLockstep` told of ``engine``'s steps and forwards (stage 3), when ZeRO's data
    group is the whole world and a rendezvous store exists; else None. Call on all ranks."""
    from lightning_zero import comm

    store = comm.default_store()
    world_size = comm.world_size(None)
    if store is None or world_size <= 1 or comm.world_size(group) != world_size:
        return None
    lockstep = StepLockstep(store, comm.rank(None), world_size, timeout)
    engine.watch_steps(lockstep)
    return lockstep
