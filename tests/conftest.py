"""Fixtures and collection rules of the whole suite; the shared code itself is in :mod:`tests.helpers`.

Code that runs inside spawned ranks cannot take fixtures (a rank imports its worker function and
calls it): it imports from ``tests.helpers`` directly. Fixtures serve the tests' own process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.helpers.trainer import quiet_trainer as _quiet_trainer


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped, with the reason in the -ra summary, where no CUDA device is."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none found")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def quiet_trainer() -> Callable[..., Any]:
    """The factory :func:`tests.helpers.trainer.quiet_trainer`: a Trainer without logger, checkpoint
    callback, progress bar or model summary unless the test turns one on."""
    return _quiet_trainer
