"""Build of the compiled part of lightning_zero (``lightning_zero._C``); all metadata is in pyproject.toml.

* C++ always (csrc/ops.cpp, csrc/cpu/*.cpp): the AVX-512 and AVX2 kernels are compiled from their
  own translation units with ``#pragma GCC target`` inside them, so the library runs on any x86-64
  and picks the path at run time; no ``-march=native`` (the wheel must run on other machines).
* CUDA (csrc/cuda/*.cu) when torch is a CUDA build and a CUDA toolkit (nvcc) is found; set
  ``LIGHTNING_ZERO_NO_CUDA=1`` to skip it.
* Never fatal: without torch, a compiler or ninja the build prints why and installs the pure-Python
  package, whose ops are compiled on first use (lightning_zero/ops/_build.py).
* The sources always travel: csrc/ is in the sdist (MANIFEST.in) and is copied into every wheel as
  ``lightning_zero/_csrc``, which the first-use build compiles.

``LIGHTNING_ZERO_BUILD_OPS``: "1" builds the extension ahead of time and fails the install if torch
is missing (as ``DS_BUILD_OPS=1``; needs ``--no-build-isolation``, so that the extension is compiled
against the torch already installed: an isolated build environment has no torch); "0" never builds
it (first-use compile only). Unset: built when torch is importable, i.e. ``pip install
--no-build-isolation -e .`` builds in place; ``pip install .`` and ``python -m build`` (isolated)
make a pure wheel.
"""

import glob
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

BUILD_OPS = os.environ.get("LIGHTNING_ZERO_BUILD_OPS", "")

HERE = os.path.dirname(os.path.abspath(__file__))


def _warn(msg):
    print(f"lightning_zero setup: {msg}", file=sys.stderr)


def _sources(pattern):
    # relative paths: setuptools rejects absolute source paths in editable installs
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern)))


class BuildPyWithSources(build_py):
    """Copies csrc/ into the built package as lightning_zero/_csrc (the sources of the first-use build)."""

    def run(self):
        super().run()
        source = os.path.join(HERE, "csrc")
        if os.path.isdir(source) and not self.editable_mode:
            target = os.path.join(self.build_lib, "lightning_zero", "_csrc")
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.sh", "__pycache__"))


def _extensions():
    if BUILD_OPS == "0":
        _warn("LIGHTNING_ZERO_BUILD_OPS=0: the ops are compiled on first use")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:  # an isolated build environment, metadata-only invocations, or no torch
        if BUILD_OPS == "1":
            raise RuntimeError(
                f"LIGHTNING_ZERO_BUILD_OPS=1 needs torch in the build environment ({exc}): install torch first and "
                "run pip with --no-build-isolation"
            ) from exc
        _warn(f"torch not importable ({exc}); the ops will be compiled on first use")
        return [], {}
    # -fopenmp at compile time only: ATen's inline at::parallel_for is an `omp parallel` region that
    # is compiled in only when _OPENMP is defined (without it the loop runs on the calling thread).
    # Nothing is added at link time: the GOMP_* symbols resolve to the libgomp that libtorch_cpu
    # already loads (torch's own runtime, the one torch.set_num_threads governs), never a second one.
    cxx = ["-O3", "-fvisibility=hidden", "-Wall"] + ([] if sys.platform == "darwin" else ["-fopenmp"])
    sources = _sources("csrc/ops.cpp") + _sources("csrc/cpu/*.cpp")
    use_cuda = (
        torch.version.cuda is not None
        and cpp_extension.CUDA_HOME is not None
        and os.environ.get("LIGHTNING_ZERO_NO_CUDA", "0") != "1"
    )
    kwargs = dict(name="lightning_zero._C", sources=sources, extra_compile_args={"cxx": cxx}, py_limited_api=False)
    if use_cuda:
        kwargs["sources"] = sources + _sources("csrc/cuda/*.cu")
        kwargs["extra_compile_args"]["nvcc"] = ["-O3", "--use_fast_math", "-lineinfo"]
        ext = cpp_extension.CUDAExtension(**kwargs)
    else:
        ext = cpp_extension.CppExtension(**kwargs)
    _warn(f"building lightning_zero._C ({'C++ + CUDA' if use_cuda else 'C++ only'})")
    return [ext], {"build_ext": _optional(cpp_extension.BuildExtension)}


def _optional(base):
    """Wrap torch's BuildExtension so that a failed compile leaves a working pure-Python package
    (unless LIGHTNING_ZERO_BUILD_OPS=1 asked for the build)."""

    class OptionalBuildExtension(base):
        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any compiler failure must not fail the install
                if BUILD_OPS == "1":
                    raise
                _warn(
                    f"compiling lightning_zero._C failed ({exc}); "
                    "lightning_zero.ops will use the PyTorch reference implementations"
                )

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001
                if BUILD_OPS == "1":
                    raise
                _warn(f"compiling {ext.name} failed ({exc}); continuing without it")

    return (
        OptionalBuildExtension.with_options(use_ninja=True) if hasattr(base, "with_options") else OptionalBuildExtension
    )


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass={**cmdclass, "build_py": BuildPyWithSources})
