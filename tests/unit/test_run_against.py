"""``benchmarks/run.py --against REF``: the worktree of the base, the sharing of the compiled library,
the environment each tree runs in, the table, and the arguments refused before anything runs.
Nothing here times anything: the runs themselves are the benchmark's business."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _against():
    """benchmarks/against.py (the benchmarks are scripts, not a package; it imports only the standard library)."""
    if "against" not in sys.modules:
        spec = importlib.util.spec_from_file_location("against", ROOT / "benchmarks" / "against.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["against"] = module  # its dataclass resolves annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules["against"]


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A two-commit repository shaped like the project: the package, csrc/, an ignored built library."""
    repo = tmp_path / "repo"
    (repo / "lightning_zero").mkdir(parents=True)
    (repo / "csrc").mkdir()
    _git(repo, "init", "--quiet")
    (repo / ".gitignore").write_text("*.so\n")
    (repo / "csrc" / "ops.cpp").write_text("// ops\n")
    (repo / "lightning_zero" / "__init__.py").write_text("VERSION = 'base'\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "--quiet", "-m", "base")
    (repo / "lightning_zero" / "__init__.py").write_text("VERSION = 'head'\n")
    _git(repo, "commit", "--quiet", "-am", "head")
    (repo / "lightning_zero" / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF built")
    return repo


def test_the_base_is_a_detached_worktree_with_the_library_and_is_removed_after(repo: Path) -> None:
    against = _against()
    with against.worktree("HEAD~1", repo) as (tree, commit, library):
        assert (tree / "lightning_zero" / "__init__.py").read_text() == "VERSION = 'base'\n"
        assert commit == _git(repo, "rev-parse", "HEAD~1").strip()
        assert _git(tree, "rev-parse", "--abbrev-ref", "HEAD").strip() == "HEAD"  # detached: no branch moved
        assert (tree / "lightning_zero" / "_C.cpython-311-x86_64-linux-gnu.so").read_bytes() == b"\x7fELF built"
        assert "copied" in library
        assert str(tree) in _git(repo, "worktree", "list")
    assert not tree.exists()
    assert str(tree) not in _git(repo, "worktree", "list")
    assert (repo / "lightning_zero" / "__init__.py").read_text() == "VERSION = 'head'\n"  # the head untouched


def test_the_library_is_not_copied_where_its_sources_differ(repo: Path) -> None:
    against = _against()
    (repo / "csrc" / "ops.cpp").write_text("// a new op\n")  # uncommitted: the working tree is the head
    with against.worktree("HEAD", repo) as (tree, _, library):
        assert not list((tree / "lightning_zero").glob("_C*"))
        assert "compiles its own" in library


def test_the_worktree_is_removed_after_an_error(repo: Path) -> None:
    against = _against()
    with pytest.raises(KeyboardInterrupt), against.worktree("HEAD~1", repo) as (tree, _, _):
        raise KeyboardInterrupt
    assert not tree.exists() and str(tree) not in _git(repo, "worktree", "list")


def test_a_ref_that_is_not_a_commit_is_refused_with_what_to_pass(repo: Path, tmp_path: Path) -> None:
    against = _against()
    with pytest.raises(ValueError, match="no such commit.*HEAD~N"):
        against.resolve("no-such-branch", repo)
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ValueError, match="needs a git checkout"):
        against.resolve("HEAD", plain)


def test_each_tree_runs_with_its_own_package_first(repo: Path, tmp_path: Path, monkeypatch) -> None:
    against = _against()
    other = tmp_path / "other"
    (other / "lightning_zero").mkdir(parents=True)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(other), "/some/tools"]))
    assert against.tree_env(repo)["PYTHONPATH"].split(os.pathsep) == [str(repo), "/some/tools"]


def test_both_trees_get_the_same_resolved_settings(repo: Path) -> None:
    against = _against()
    plan = against.Plan(["zero3"], ["gpt"], ["bf16-mixed"], steps=5, warmup=2, repetitions=3, rss=False, quick=True)
    command = plan.command(repo, "zero3", repo / "out")
    assert command[1] == str(repo / "benchmarks" / "run.py")
    joined = " ".join(command)
    for part in ("--systems zero3", "--rounds 1", "--precisions bf16-mixed", "--steps 5", "--warmup 2", "--no-rss"):
        assert part in joined


def test_the_table_compares_medians_and_memory_per_configuration() -> None:
    against = _against()
    mib = 2**20

    def record(steps: list[float], mib_bytes: int, rss: int) -> dict:
        return {
            "median_s": sorted(steps)[len(steps) // 2],
            "steps_s": steps,
            "bytes": mib_bytes * mib,
            "peak_rss": rss * mib,
        }

    samples = {
        ("gpt", "bf16-mixed", "zero3"): {
            "base": [record([0.4, 0.5, 0.6], 122, 300), record([0.5, 0.5, 0.5], 122, 310)],
            "head": [record([0.5, 0.6, 0.7], 124, 305), record([0.5, 0.55, 0.6], 124, 300)],
        },
        ("gpt", "bf16-mixed", "zero2"): {"base": [record([0.4], 100, 200)], "head": [{"errors": ["boom"]}]},
    }
    rows = against.table_rows(samples, rss=True)
    assert len(against.headers(rss=True)) == len(rows[0]) == len(rows[1])
    # pooled medians 0.5 and 0.575 s; per-repetition ratios 0.6/0.5 and 0.55/0.5; the larger bytes of the repetitions
    assert rows[0][:3] == ["gpt", "zero3", "bf16-mixed"]
    assert rows[0][3:] == ["500", "575", "1.150", "1.10-1.20", "122.0", "124.0", "+2.0", "310.0", "305.0", "-5.0", "ok"]
    assert rows[1][3:7] == ["400", "-", "-", "-"] and rows[1][-1] == "1 failed"


def test_run_py_refuses_a_ref_git_cannot_resolve_before_running_anything() -> None:
    # one process that imports torch and Lightning and exits at argument parsing (a few seconds)
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--against", "no-such-ref-anywhere"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 2 and "no such commit" in done.stderr, done.stderr[-500:]
