"""Compiling the ops on first use (JIT), as DeepSpeed's op builder does, when no prebuilt ``lightning_zero._C`` exists.

A wheel installed with plain ``pip install`` carries the C++/CUDA sources (``lightning_zero/_csrc``);
a source checkout has them in ``csrc/``. The first process that needs the ops compiles them with
ninja (``torch.utils.cpp_extension.load``) into a cache directory named by the torch version, the
Python version, the CUDA version and a hash of the sources, and loads the library into
``torch.ops.lightning_zero``; later processes load the cached library. An exclusive file lock
around the build makes ranks that start together compile once: the first builds, the others wait
and load its result. One line on stderr says that a compile is running and where.

Environment:
    ``LIGHTNING_ZERO_CACHE``: the cache root (default ``$XDG_CACHE_HOME/lightning_zero`` or
    ``~/.cache/lightning_zero``).
    ``LIGHTNING_ZERO_JIT=0``: never compile; without a prebuilt library the PyTorch reference runs.
    ``LIGHTNING_ZERO_NO_CUDA=1``: leave the CUDA kernels out (as at install).
    ``CXX``: the C++ compiler (torch's default: ``c++``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch

NAME = "lightning_zero_C"
CACHE_ENV = "LIGHTNING_ZERO_CACHE"
JIT_ENV = "LIGHTNING_ZERO_JIT"


def source_dir() -> Path | None:
    """The directory holding ops.cpp, cpu/ and cuda/: the wheel's copy, else the checkout's csrc/."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "_csrc", package.parent / "csrc"):
        if (candidate / "ops.cpp").is_file():
            return candidate
    return None


def _sources(root: Path, cuda: bool) -> list[Path]:
    files = [root / "ops.cpp", *sorted((root / "cpu").glob("*.cpp"))]
    return files + (sorted((root / "cuda").glob("*.cu")) if cuda else [])


def _use_cuda() -> bool:
    from torch.utils import cpp_extension

    return (
        torch.version.cuda is not None
        and cpp_extension.CUDA_HOME is not None
        and os.environ.get("LIGHTNING_ZERO_NO_CUDA", "0") != "1"
    )


def cache_dir(root: Path, cuda: bool) -> Path:
    """Where this torch, Python and source tree's build lives (a new directory when any changes)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lightning_zero"
    )
    device = f"cu{torch.version.cuda}" if cuda else "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(base) / f"torch{torch.__version__}-{py}-{device}" / digest.hexdigest()[:16]


def _missing_tools() -> str | None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not found; install g++ or set CXX)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def load() -> str | None:
    """Load the ops from the cache, compiling them first if needed; None on success, else why not."""
    if os.environ.get(JIT_ENV, "1") == "0":
        return f"{JIT_ENV}=0"
    root = source_dir()
    if root is None:
        return "the C++ sources are not in this installation (lightning_zero/_csrc)"
    cuda = _use_cuda()
    target = cache_dir(root, cuda)
    library = target / f"{NAME}.so"
    try:
        target.mkdir(parents=True, exist_ok=True)
        with open(target / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the process ends, even by a crash
            if not library.is_file():
                reason = _missing_tools()
                if reason is not None:
                    return reason
                _compile(root, target, cuda)
        torch.ops.load_library(str(library))
    except Exception as exc:  # noqa: BLE001 - a failed build must leave the reference path working
        return f"compiling the ops into {target} failed: {str(exc).strip().splitlines()[-1] if str(exc) else exc!r}"
    return None


def _compile(root: Path, target: Path, cuda: bool) -> None:
    from torch.utils import cpp_extension

    # the flags of setup.py: -fopenmp at compile time only (ATen's parallel_for), no -march=native
    cxx = ["-O3", "-fvisibility=hidden", "-Wall"] + ([] if sys.platform == "darwin" else ["-fopenmp"])
    start = time.monotonic()
    print(
        f"lightning_zero: compiling the {'C++/CUDA' if cuda else 'C++'} ops for torch {torch.__version__} into "
        f"{target} (first use only; about a minute)",
        file=sys.stderr,
        flush=True,
    )
    cpp_extension.load(
        name=NAME,
        sources=[str(p) for p in _sources(root, cuda)],
        extra_cflags=cxx,
        extra_cuda_cflags=["-O3", "--use_fast_math", "-lineinfo"],
        build_directory=str(target),
        with_cuda=cuda,
        is_python_module=False,
        verbose=False,
    )
    print(f"lightning_zero: ops compiled in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
