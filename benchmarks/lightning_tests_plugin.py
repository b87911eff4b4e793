"""pytest plugin loaded by ``benchmarks/lightning_tests.py`` into each of the two rank processes.

Lightning's own ``tests_pytorch`` build Trainers with ``strategy="auto"``, ``"ddp"``, ``"ddp_spawn"``
or ``DDPStrategy(...)`` on one or two devices. This plugin runs every such Trainer on the two CPU
ranks that the runner started (``LOCAL_RANK``/``WORLD_SIZE`` in the environment, so Lightning's
launchers create no processes) under one system:

* ``ddp``: Lightning's ``DDPStrategy`` (gloo), the reference;
* ``zero1`` ... ``zero3_offload``: the registered ``ZeroStrategy`` names, with ``LZ_LT_ZERO_OPTIONS``
  (string options ``name=value,...``; default ``state_dict_type=full``).

A Trainer asking for another strategy (FSDP, DeepSpeed, a custom class) keeps it. What keeps the two
ranks on the same test: a store of the runner's (``LZ_LT_SYNC_PORT``) where each rank checks in
before each test and waits for the other; each test rendezvouses on its own ``MASTER_PORT``, and the
strategies' collectives time out (``LZ_LT_PG_TIMEOUT`` seconds) so a rank that failed alone leaves its
peer a failure instead of a hang (rank 0 picks a free port per test and shares it through the store).
``tmp_path`` is the same directory on both ranks (Lightning's
checkpoint callbacks broadcast rank 0's path; tests that list it then see what both ranks wrote).
"""

from __future__ import annotations

import functools
import os
import re
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

SYSTEM = os.environ.get("LZ_LT_SYSTEM", "ddp")
RANK = int(os.environ.get("LOCAL_RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "2"))
PG_TIMEOUT = timedelta(seconds=float(os.environ.get("LZ_LT_PG_TIMEOUT", "90")))
SYNC_TIMEOUT = float(os.environ.get("LZ_LT_SYNC_TIMEOUT", "900"))
TMP_ROOT = Path(os.environ.get("LZ_LT_TMP", "/tmp/lz_lightning_tests"))
# Lightning's tests torch.load the checkpoint files they write: the ZeRO systems write Lightning's
# one-file format (the default, sharded directories, would fail those tests for the format alone)
ZERO_OPTIONS = os.environ.get("LZ_LT_ZERO_OPTIONS", "state_dict_type=full")
_SWAPPED = ("auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true")
_store: Any = None
_count = 0
_swapped = 0


def make_strategy() -> Any:
    """The strategy of this run's system, on gloo, with a short collective timeout."""
    if SYSTEM == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo", timeout=PG_TIMEOUT)
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_zero  # noqa: F401 - registers the names

    entry = StrategyRegistry[SYSTEM]
    options = dict(option.split("=", 1) for option in ZERO_OPTIONS.split(",") if option)
    return entry["strategy"](
        **{**entry["init_params"], **options, "process_group_backend": "gloo", "timeout": PG_TIMEOUT}
    )


def _is_swapped(strategy: Any) -> bool:
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    if isinstance(strategy, str):
        return strategy in _SWAPPED
    return type(strategy) in (DDPStrategy, SingleDeviceStrategy)


def _patch_trainer() -> None:
    from lightning.pytorch import Trainer

    original = Trainer.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if _is_swapped(kwargs.get("strategy", "auto")) and kwargs.get("accelerator", "auto") in ("auto", "cpu"):
            global _swapped
            _swapped += 1
            kwargs.update(strategy=make_strategy(), accelerator="cpu", devices=WORLD, num_nodes=1)
        original(self, *args, **kwargs)

    Trainer.__init__ = __init__  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    """Connect to the runner's sync store and swap the Trainer's strategy."""
    global _store
    # Lightning's CI marks reruns with pytest-rerunfailures; here a test runs once under every system
    config.addinivalue_line("markers", "flaky: rerun by pytest-rerunfailures in Lightning's CI")
    _store = dist.TCPStore(
        "127.0.0.1",
        int(os.environ["LZ_LT_SYNC_PORT"]),
        WORLD,
        is_master=RANK == 0,
        timeout=timedelta(seconds=SYNC_TIMEOUT),
    )
    _patch_trainer()


def _wait_for_peers(key: str) -> None:
    _store.add(key, 1)
    deadline = time.monotonic() + SYNC_TIMEOUT
    while _store.add(key, 0) < WORLD:
        if time.monotonic() > deadline:
            pytest.fail(f"rank {RANK}: the other rank did not reach {key} in {SYNC_TIMEOUT:.0f} s")
        time.sleep(0.05)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Both ranks start each test together, on a port of that test's own."""
    global _count
    _count += 1
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    key = f"setup/{_count}/{item.nodeid}"
    if RANK == 0:
        # a port free now (a fixed one may be taken by another program on a shared machine)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            _store.set(f"port/{key}", str(s.getsockname()[1]))
    os.environ["MASTER_PORT"] = _store.get(f"port/{key}").decode()
    _wait_for_peers(key)


@pytest.fixture
def tmp_path(request: pytest.FixtureRequest) -> Path:
    """One directory per test, the same on both ranks."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid)[-150:]
    path = TMP_ROOT / SYSTEM / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How many Trainers ran under the system (a check that the swap happened)."""
    terminalreporter.write_line(f"lightning_tests_plugin: {_swapped} Trainers on {WORLD} ranks under {SYSTEM}")
