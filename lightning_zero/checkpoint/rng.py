"""Random states of one rank (torch, CUDA, NumPy, Python) as tensors and primitives.

Lightning's checkpoints do not hold random states; ours do, per rank, so that a resumed run draws
the same dropout masks (and anything else random) as the uninterrupted one. NumPy's state is
stored as a tensor, not as an ``ndarray``, so that the file loads with ``weights_only=True``.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional for torch
    np = None  # type: ignore[assignment]  # the optional module is None when absent


def collect() -> dict[str, Any]:
    """This process's random states."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        assert isinstance(keys, np.ndarray)  # the legacy MT19937 state is a tuple with the key array
        states["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    return states


def restore(states: dict[str, Any]) -> None:
    """Set this process's random states to ``states`` (from :func:`collect`)."""
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states and np is not None:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
