"""How many CPU threads a rank's host optimizer step (and the rest of torch's CPU ops) gets.

The compiled CPU optimizers (lightning_zero.ops) run on ``at::parallel_for``, i.e. on torch's own
OpenMP pool, so ``torch.set_num_threads`` is the one knob. The choice, in order:

1. ``threads`` passed explicitly (an option of the caller): used as given.
2. ``OMP_NUM_THREADS`` set in the environment: torch already honours it; kept. One exception:
   torchrun sets ``OMP_NUM_THREADS=1`` for every worker when it starts more than one per machine
   and the user set nothing; with ``TORCHELASTIC_RUN_ID`` present and the value ``1`` it is taken as
   torchrun's default, not a choice (pass ``threads=1`` to really want one thread).
3. Otherwise the rank's share of the physical cores it may run on: physical cores of
   ``os.sched_getaffinity(0)`` divided by the number of ranks on this machine, at least 1. Ranks on
   one machine share the cores; torch's default (every core in every rank) oversubscribes them.

``choose_threads`` only decides (and is what the tests call); ``apply_threads`` sets torch's pool
and logs the choice in one line.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

import torch

log = logging.getLogger(__name__)


def physical_cores(cpus: Iterable[int]) -> int:
    """Distinct (package, core) pairs among ``cpus`` per sysfs; ``len(cpus)`` where sysfs is absent."""
    cpus = list(cpus)
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as pkg, open(f"{base}/core_id") as core:
                cores.add((pkg.read().strip(), core.read().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def choose_threads(
    local_world_size: int,
    threads: int | None = None,
    env: Mapping[str, str] | None = None,
    cpus: Iterable[int] | None = None,
) -> tuple[int, str]:
    """``(threads, why)`` for one rank of ``local_world_size`` on this machine; see the module docstring."""
    env = os.environ if env is None else env
    if local_world_size < 1:
        raise ValueError(f"local_world_size={local_world_size}: must be the number of ranks on this machine (>= 1)")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads={threads}: pass a positive number of CPU threads per rank, or None to choose")
        return threads, "threads option"
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp:
        try:
            value = int(omp)
        except ValueError:
            raise ValueError(
                f"OMP_NUM_THREADS={omp!r} is not an integer; set it to a thread count or unset it"
            ) from None
        if value < 1:
            raise ValueError(f"OMP_NUM_THREADS={value}: set it to a positive thread count or unset it")
        if not (value == 1 and "TORCHELASTIC_RUN_ID" in env and local_world_size > 1):
            return value, "OMP_NUM_THREADS"
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    cores = physical_cores(cpus)
    share = max(1, cores // local_world_size)
    return share, f"{cores} physical cores in the affinity mask / {local_world_size} local ranks"


def apply_threads(local_world_size: int, threads: int | None = None) -> int:
    """Choose, ``torch.set_num_threads`` it, log one line, return the count."""
    n, why = choose_threads(local_world_size, threads)
    torch.set_num_threads(n)
    log.info("lightning_zero: %d CPU threads per rank (%s)", n, why)
    return n
