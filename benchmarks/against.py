"""``run.py --against REF``: the working tree against a git ref, in one run, one table.

The base is checked out as a detached ``git worktree`` in a temporary directory (removed at the
end). Both trees' compiled ops are made the same where they can be: when ``csrc/`` and ``setup.py``
are the same in both, the working tree's ``lightning_zero/_C*.so`` is copied into the base; else the
base compiles its own on first use (``lightning_zero/ops/_build.py``, before any timed run). A probe
in each tree says which ``lightning_zero`` it imports and whether its ops are compiled; a base
without them runs the PyTorch reference, and the table's notes say so.

Every measured run is the tree's own ``benchmarks/run.py`` (its own measurement code, its own
package: a subprocess with ``PYTHONPATH`` set to that tree and nothing else of lightning_zero's) for
one system and one round, with the workloads, precisions and step counts fixed here so that both
trees measure the same thing. Runs are interleaved per system and repetition, base and head in
alternating order (base, head; then head, base), so that a busy moment of the machine hits both
alike. The table reports, per system, the median step of all kept steps of each tree and their
ratio, with the range of the per-repetition ratios (how much the machine moved), and the bytes per
rank (live tensors, largest rank; peak RSS growth too unless ``--no-rss``) of each tree.

This module imports only the standard library at load (the tests use it without torch); ``common``
is imported where the machine description and the table are made.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
#: what decides whether the working tree's compiled library fits the base's Python front
EXTENSION_SOURCES = ("csrc", "setup.py")
#: prints, as JSON, the package a tree imports and whether its compiled ops load (JIT-compiling them
#: if needed, so a compile never lands inside a timed run). Tolerates trees whose ops module differs.
PROBE = """
import json, lightning_zero
try:
    from lightning_zero.ops import _load
    ok = bool(_load.compiled()); why = _load._LOAD_ERROR
except ImportError:
    try:
        from lightning_zero import _C  # noqa: F401
        ok, why = True, None
    except ImportError as error:
        ok, why = False, str(error)
print(json.dumps({"file": lightning_zero.__file__, "compiled": ok, "why": why}))
"""


def git(root: Path, *args: str) -> str:
    """``git -C root args`` -> stdout (stripped); a ``ValueError`` with git's message on failure."""
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise ValueError(f"git {' '.join(args)} failed in {root}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


def resolve(ref: str, root: Path = ROOT) -> str:
    """The full commit id of ``ref`` (a branch, tag, ``HEAD~1``, a hash), or a ``ValueError``
    saying what to pass instead."""
    try:
        git(root, "rev-parse", "--git-dir")
    except ValueError as error:
        raise ValueError(f"--against needs a git checkout; {root} is not one ({error})") from None
    try:
        return git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except ValueError:
        raise ValueError(
            f"--against {ref!r}: no such commit in {root}; pass a branch, a tag, HEAD~N or a commit id "
            "(`git log --oneline` lists them; a shallow clone may need `git fetch --unshallow`)"
        ) from None


def extension_files(tree: Path) -> list[Path]:
    """The compiled ops library files of a tree (``lightning_zero/_C*.so`` / ``.pyd``)."""
    return sorted(p for p in (tree / "lightning_zero").glob("_C*") if p.suffix in (".so", ".pyd"))


def share_extension(head: Path, base: Path, commit: str) -> str:
    """Copy the head's compiled library into the base tree where the sources it was built from are the
    same in both; returns one sentence saying what was done."""
    found = extension_files(head)
    if not found:
        return "the working tree has no prebuilt lightning_zero/_C*.so: each tree loads or compiles its own"
    changed = subprocess.run(
        ["git", "-C", str(head), "diff", "--quiet", commit, "--", *EXTENSION_SOURCES], check=False
    ).returncode
    if changed:
        return (
            f"{' and '.join(EXTENSION_SOURCES)} differ between the trees: the base compiles its own ops on "
            "first use instead of a copy of the working tree's library"
        )
    for path in found:
        shutil.copy2(path, base / "lightning_zero" / path.name)
    return f"the working tree's {', '.join(p.name for p in found)} copied into the base (same {'/'.join(EXTENSION_SOURCES)})"


@contextlib.contextmanager
def worktree(ref: str, root: Path = ROOT) -> Iterator[tuple[Path, str, str]]:
    """A detached checkout of ``ref`` in a temporary directory, with the compiled library shared
    (:func:`share_extension`); yields ``(path, commit id, what was done about the library)``. The
    worktree is removed (and git's record of it pruned) on exit, also after an error or Ctrl-C."""
    commit = resolve(ref, root)
    scratch = Path(tempfile.mkdtemp(prefix="lightning_zero_against_"))
    tree = scratch / "base"
    try:
        git(root, "worktree", "add", "--detach", "--quiet", str(tree), commit)
        yield tree, commit, share_extension(root, tree, commit)
    finally:
        with contextlib.suppress(ValueError):
            git(root, "worktree", "remove", "--force", str(tree))
        shutil.rmtree(scratch, ignore_errors=True)
        with contextlib.suppress(ValueError):
            git(root, "worktree", "prune")


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a run in ``tree``: ``PYTHONPATH`` is the tree, plus any entry of the
    current one that is not a lightning_zero checkout (so the other tree's package cannot shadow it)."""
    env = dict(os.environ)
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not (Path(p) / "lightning_zero").is_dir()]
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *keep])
    return env


def probe(tree: Path) -> dict[str, Any]:
    """Which ``lightning_zero`` a run in ``tree`` imports and whether its compiled ops load; a
    ``ValueError`` when it imports another tree's package (the A/B would compare a tree with itself)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tree, env=tree_env(tree), capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise ValueError(f"lightning_zero does not import in {tree}:\n{done.stderr[-2000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(found["file"]).resolve().is_relative_to(tree.resolve()):
        raise ValueError(f"a run in {tree} imports lightning_zero from {found['file']} (an installed copy?)")
    return found


@dataclass
class Plan:
    """What every run measures: the same for both trees (``run.py``'s own defaults resolved once here)."""

    systems: list[str]
    workloads: list[str]
    precisions: list[str]
    steps: int
    warmup: int
    repetitions: int
    rss: bool = True
    smoke: bool = False
    quick: bool = False

    def command(self, tree: Path, system: str, out: Path) -> list[str]:
        """The command line of one run of ``system`` in ``tree`` (one round, results in ``out``)."""
        args = [sys.executable, str(tree / "benchmarks" / "run.py"), "--systems", system, "--rounds", "1"]
        args += ["--workloads", ",".join(self.workloads), "--precisions", ",".join(self.precisions)]
        args += ["--steps", str(self.steps), "--warmup", str(self.warmup), "--no-cpu-adam", "--out", str(out)]
        args += ["--quick"] * self.quick + ["--smoke"] * self.smoke + ["--no-rss"] * (not self.rss)
        return args


def run_one(tree: Path, system: str, plan: Plan, out: Path) -> list[dict[str, Any]]:
    """One run of ``system`` in ``tree``: its records (``report.summarize``'s, as results.json holds
    them), or one record per configuration with the error where the run failed."""
    out.mkdir(parents=True)
    log = out / "log.txt"
    with log.open("w") as sink:
        done = subprocess.run(
            plan.command(tree, system, out), cwd=tree, env=tree_env(tree), stdout=sink, stderr=subprocess.STDOUT
        )
    results = out / "results.json"
    if done.returncode or not results.is_file():
        tail = log.read_text()[-3000:]
        print(f"[run.py --against] {system} in {tree} failed (exit {done.returncode}):\n{tail}", file=sys.stderr)
        return [
            {"workload": w, "precision": p, "system": system, "errors": [tail]}
            for w in plan.workloads
            for p in plan.precisions
        ]
    return list(json.loads(results.read_text())["results"])


def measure(trees: dict[str, Path], plan: Plan, scratch: Path) -> dict[tuple[str, str, str], dict[str, list]]:
    """Every run, interleaved: per repetition, per system, both trees (their order alternating by
    repetition). Returns ``{(workload, precision, system): {tree label: [record per repetition]}}``."""
    samples: dict[tuple[str, str, str], dict[str, list]] = {}
    labels = list(trees)
    for rep in range(plan.repetitions):
        order = labels if rep % 2 == 0 else labels[::-1]
        for system in plan.systems:
            for label in order:
                records = run_one(trees[label], system, plan, scratch / f"{rep}-{system}-{label}")
                for r in records:
                    key = (r["workload"], r["precision"], r["system"])
                    samples.setdefault(key, {name: [] for name in labels})[label].append(r)
                    said = (
                        f"median step {r['median_s'] * 1e3:.0f} ms, {r['bytes'] / MIB:.1f} MiB"
                        if "median_s" in r
                        else "failed"
                    )
                    print(
                        f"[run.py --against] {rep + 1}/{plan.repetitions} {' '.join(key)} {label}: {said}",
                        file=sys.stderr,
                        flush=True,
                    )
    return samples


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def _delta(head: float | None, base: float | None) -> str:
    return "-" if head is None or base is None else f"{(head - base) / MIB:+.1f}"


def compare(records: dict[str, list[dict[str, Any]]], rss: bool) -> list[str]:
    """One table row from both trees' records of one configuration (``base`` and ``head``)."""
    ok = {t: [r for r in records[t] if "median_s" in r] for t in ("base", "head")}
    steps = {t: [s for r in ok[t] for s in r["steps_s"]] for t in ok}
    median = {t: statistics.median(steps[t]) if steps[t] else None for t in ok}
    paired = [
        h["median_s"] / b["median_s"]
        for b, h in zip(records["base"], records["head"], strict=False)
        if "median_s" in b and "median_s" in h
    ]

    def worst(tree: str, key: str) -> float | None:
        values = [r[key] for r in ok[tree] if isinstance(r.get(key), (int, float))]
        return max(values) if values else None

    base_ms, head_ms = median["base"], median["head"]
    row = [
        "-" if base_ms is None else f"{base_ms * 1e3:.0f}",
        "-" if head_ms is None else f"{head_ms * 1e3:.0f}",
        "-" if base_ms is None or head_ms is None else f"{head_ms / base_ms:.3f}",
        ("-" if not paired else f"{min(paired):.2f}" + (f"-{max(paired):.2f}" if len(paired) > 1 else "")),
    ]
    for key in ("bytes", "peak_rss") if rss else ("bytes",):
        row += [_mib(worst("base", key)), _mib(worst("head", key)), _delta(worst("head", key), worst("base", key))]
    failed = sum(len(records[t]) - len(ok[t]) for t in ok)
    return row + [f"{failed} failed" if failed else "ok"]


def headers(rss: bool) -> list[str]:
    """The table's column names (peak RSS columns only where the runs measured it)."""
    cols = ["workload", "system", "precision", "base step ms", "head step ms", "head ÷ base", "per-repetition ratios"]
    cols += ["base MiB/rank", "head MiB/rank", "Δ MiB"]
    if rss:
        cols += ["base peak RSS MiB/rank", "head peak RSS MiB/rank", "Δ RSS MiB"]
    return cols + ["runs"]


def table_rows(samples: dict[tuple[str, str, str], dict[str, list]], rss: bool) -> list[list[str]]:
    """Every configuration's row, in the order they were run."""
    return [
        [workload, system, precision, *compare(records, rss)]
        for (workload, precision, system), records in samples.items()
    ]


def run(ref: str, plan: Plan, out: Path, command: str) -> Path:
    """The whole comparison: worktree, probes, interleaved runs, table on stdout, JSON in ``out``."""
    import common

    with worktree(ref, ROOT) as (base, commit, library):
        trees = {"base": base, "head": ROOT}
        found = {label: probe(tree) for label, tree in trees.items()}
        notes = [
            f"Base: `{ref}` ({commit[:12]}), a detached worktree; head: the working tree. {library[0].upper()}{library[1:]}."
        ]
        for label, info in found.items():
            ops = "compiled ops" if info["compiled"] else f"the PyTorch reference ops (not compiled: {info['why']})"
            notes.append(f"{label.capitalize()}: lightning_zero from {info['file']}, {ops}.")
            print(f"[run.py --against] {notes[-1]}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="lightning_zero_against_runs_") as scratch:
            samples = measure(trees, plan, Path(scratch))
    notes.append(
        f"Each tree's own benchmarks/run.py, one system and one round per run, {plan.repetitions} repetition(s) "
        "interleaved per system (base, head; then head, base). Step: median of all kept steps of rank 0 of a "
        f"tree's runs ({plan.steps} timed after {plan.warmup} warm-up per run); per-repetition ratios: head's "
        "median over base's in each repetition (their spread is the machine's noise; a range that spans 1.00 "
        "shows no difference). MiB/rank: live tensors at the end of the last step, largest rank, the larger of "
        "the repetitions" + ("; peak RSS: OS peak resident growth per rank in fresh ranks." if plan.rss else ".")
    )
    for key, records in samples.items():
        for label, runs in records.items():
            for r in runs:
                if r.get("errors"):
                    lines = r["errors"][0].strip().splitlines() or ["no output"]
                    notes.append(f"{label.capitalize()}, {' '.join(key)}: error: {lines[-1][:200]}")
    cols, rows = headers(plan.rss), table_rows(samples, plan.rss)
    print("\n" + common.format_table(cols, rows))
    for note in notes:
        print(note)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "against.json"
    payload = {
        "title": f"run.py --against: the working tree against {ref}, one interleaved run",
        "topic": "run",
        "command": command,
        "machine": {**common.machine(), "base": f"{ref} ({commit[:12]})"},
        "headers": cols,
        "rows": rows,
        "notes": notes,
        "samples": [{"configuration": list(key), **records} for key, records in samples.items()],
    }
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path
