"""A plain install: ``python -m build`` makes an sdist and a pure wheel that carry the C++ sources; the
wheel, installed into a fresh virtual environment, compiles its ops on first use, once for two
processes that start together, and falls back to the PyTorch reference without a compiler.

The fresh environment gets torch (and lightning, which the package imports) through a ``.pth`` file
naming this interpreter's site-packages instead of a ``pip install torch``: the same torch build,
without copying ~1 GB or reaching a package index, and the venv's own site-packages (where the wheel
goes) comes first on ``sys.path``. The wheel is installed with ``--no-deps --no-index`` for the same
reason. The first-use compile is ~70 s of CPU: marked slow (deselect with ``-m "not slow"``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

CHECK = """
import lightning_zero, torch
from lightning_zero import ops
assert "/env/" in lightning_zero.__file__, lightning_zero.__file__  # the installed wheel, not the checkout
print("compiled", ops.compiled(), ops.available()["cpu_adam"], flush=True)
if ops.compiled():
    p, q = (torch.nn.Parameter(torch.linspace(-1, 1, 1001)) for _ in range(2))
    p.grad = q.grad = torch.linspace(1, -2, 1001)
    ops.CPUAdam([p], lr=0.1, weight_decay=0.01).step()
    torch.optim.AdamW([q], lr=0.1, weight_decay=0.01).step()
    torch.testing.assert_close(p, q)  # fp32 Adam: one step, rounding only
"""


def _copy_sources(target: Path) -> None:
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(ROOT / name, target / name)
    ignore = shutil.ignore_patterns("*.so", "*.o", "__pycache__", "_csrc")
    shutil.copytree(ROOT / "lightning_zero", target / "lightning_zero", ignore=ignore)
    shutil.copytree(ROOT / "csrc", target / "csrc", ignore=ignore)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LIGHTNING_ZERO_JIT", "CXX")}
    return {**env, **extra}


@pytest.mark.timeout(1200)
def test_wheel_in_a_fresh_venv_compiles_its_ops_once(tmp_path):
    src, dist = tmp_path / "src", tmp_path / "dist"
    src.mkdir()
    _copy_sources(src)
    # --no-isolation (offline) with LIGHTNING_ZERO_BUILD_OPS=0 builds what an isolated build (no torch) builds
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
        check=True,
        capture_output=True,
        env=_env(LIGHTNING_ZERO_BUILD_OPS="0"),
    )
    (wheel,) = dist.glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")  # pure: nothing compiled at install
    names = zipfile.ZipFile(wheel).namelist()
    assert "lightning_zero/_csrc/ops.cpp" in names and not [n for n in names if n.endswith(".so")]

    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    Path(purelib.decode().strip(), "outer.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, env=_env()
    )

    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [python, "-c", CHECK],
            cwd=tmp_path,
            env=_env(LIGHTNING_ZERO_CACHE=str(cache)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=1100) for p in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
        assert "compiled True" in out, (out, err)
    compiles = sum(err.count("lightning_zero: compiling the") for _, err in outputs)
    assert compiles == 1, [err for _, err in outputs]  # the lock: one process compiles, the other loads its result
    assert len(list(cache.rglob("lightning_zero_C.so"))) == 1

    # A machine without a compiler: today's fallback, and a warning that says why.
    result = subprocess.run(
        [python, "-W", "always", "-c", CHECK],
        cwd=tmp_path,
        env=_env(LIGHTNING_ZERO_CACHE=str(tmp_path / "empty"), CXX="/nonexistent/c++"),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "compiled False reference" in result.stdout
    assert "no C++ compiler" in result.stderr and "the compiled extension is not available" in result.stderr
