"""Rules for what a reader meets: no dates, commit hashes or tracker references in README, docs and
the package's source; README links that resolve; a README that fits on a few screens.

A reader has neither the tracker nor the development history: "issue 17", "at 1ca6f65" or
"measured 2026-12-04" in prose or a comment says nothing to them and goes stale. Measurements with
their date, machine and version live as data in ``benchmarks/results/*.json`` and are rendered into
the Benchmarks page at build time (``scripts/docs_hooks.py``), so the page sources stay clean.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATE = re.compile(r"\b(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])\b")
ISSUE = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)
# 7-40 hex digits with at least one letter and one digit, not part of a longer word or a 0x literal
HASH = re.compile(r"(?<![\w.#-])(?=[0-9a-f]{0,39}[a-f])(?=[0-9a-f]{0,39}\d)[0-9a-f]{7,40}(?![\w-])")


def checked_files() -> list[Path]:
    """The files a reader meets: README, the docs pages, and the package's Python sources."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted((ROOT / "lightning_zero").rglob("*.py"))
    return [f for f in files if f.is_file()]


def findings(text: str, changelog: bool = False) -> list[tuple[int, str, str]]:
    """(line number, kind, match) of every date, commit hash and tracker reference in ``text``.

    The changelog's release headings carry their dates by Keep a Changelog's convention.
    """
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if changelog and line.startswith("## ["):
            continue
        for kind, pattern in (("date", DATE), ("issue", ISSUE), ("commit hash", HASH)):
            out += [(number, kind, m.group(0)) for m in pattern.finditer(line)]
    return out


@pytest.mark.parametrize(
    "text, kinds",
    [
        ("measured 2026-12-04 at 15:40", ["date"]),
        ("fixed in issue 17, see Issue #3", ["issue", "issue"]),
        ("lightning_zero 1ca6f65 + README", ["commit hash"]),
        ("main f3841a5e9c0d1b2a3f4e5d6c7b8a9f0e1d2c3b4a", ["commit hash"]),
        ("0xdeadbeef, a 1024-element buffer, 12345678 bytes, abcdefab, sha256", []),
        ("a tissue 5 cm", []),
    ],
)
def test_the_patterns(text, kinds):
    assert [k for _, k, _ in findings(text)] == kinds


def test_readme_docs_and_sources_are_clean():
    found = []
    for path in checked_files():
        for number, kind, match in findings(path.read_text(encoding="utf-8"), changelog=path.name == "CHANGELOG.md"):
            found.append(f"{path.relative_to(ROOT)}:{number}: {kind} {match!r}")
    assert not found, (
        "dates, commit hashes or tracker references (move measurements to benchmarks/results):\n" + "\n".join(found)
    )


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_links_point_at_files():
    """The README is read on GitHub and on the package index, outside the docs build's link check."""
    missing = []
    for target in LINK.findall((ROOT / "README.md").read_text(encoding="utf-8")):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (ROOT / target).exists():
            missing.append(target)
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_fits_on_a_few_screens():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/ (at most 200)"


def test_ci_runs_the_readme_test_command_and_the_docs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash scripts/run.sh test" in readme and "bash scripts/run.sh demo" in readme
    assert "\nbash scripts/run.sh test" in ci and "\nbash scripts/run.sh docs" in ci


def _hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_result_says_how_where_and_when():
    """Each result the Benchmarks page renders names its command, its machine, the versions and a date."""
    import json

    hooks = _hooks()
    results = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert results
    for path in results:
        data = json.loads(path.read_text())
        machine = data.get("machine", {})
        assert data.get("command") or path.stem in hooks.COMMANDS, f"{path.name}: no command"
        assert machine.get("cpu") or machine.get("gpu"), f"{path.name}: no machine"
        assert machine.get("torch") and machine.get("date"), f"{path.name}: no versions or date"
        assert hooks._topic(path.stem, data) in hooks.GROUPS, f"{path.name}: topic not on the page"
        rendered = hooks.render_result(path.stem, data)
        fences = [line for line in rendered.splitlines() if line.strip().startswith("```")]
        assert len(fences) % 2 == 0, f"{path.name}: a code fence is left open"
        # dates and versions are the provenance of a measurement; tracker numbers mean nothing to a reader
        assert not ISSUE.search(rendered), f"{path.name}: {ISSUE.search(rendered).group(0)!r}"


def test_a_result_renders_as_a_table():
    data = {
        "title": "t",
        "command": "python benchmarks/x.py",
        "machine": {"cpu": "c", "torch": "2", "date": "d"},
        "headers": ["a", "b|c"],
        "rows": [[1, None]],
        "notes": ["n"],
    }
    text = _hooks().render_result("x", data)
    assert "### t" in text and "`python benchmarks/x.py`" in text and "cpu: c; torch: 2; date: d" in text
    assert "| a | b\\|c |" in text and "| 1 | - |" in text and text.rstrip().endswith("n")


def test_the_options_page_lists_every_option():
    """docs/options.md has a row for every ZeroStrategy option (Lightning's DDP arguments aside)."""
    import inspect

    import lightning_zero

    ddp = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
    ddp |= {"process_group_backend", "start_method"}
    page = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    names = [n for n in inspect.signature(lightning_zero.ZeroStrategy.__init__).parameters if n != "self"]
    missing = [n for n in names if n not in ddp and f"| `{n}` |" not in page]
    assert not missing, f"docs/options.md has no row for {missing}"
