"""MkDocs hooks: render the benchmark results kept as data into the Benchmarks page.

Every ``benchmarks/results/*.json`` becomes one section of ``docs/benchmarks.md`` at build time
(where the page says ``<!-- benchmark-results -->``), with the command that produced it, the
machine, the versions and the date, so a re-run replaces a file instead of editing prose. Two
shapes are read: the one ``benchmarks/common.py``'s ``write_json`` writes (``machine`` plus
``headers``/``rows``, or a Markdown ``table``/``tables``) and the same with ``title``, ``command``
and ``notes``. The plots (``benchmarks/results/*.png``) are published beside the page.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MARKER = "<!-- benchmark-results -->"
# The page's sections, in order: a file's ``topic`` field (or, for files a script wrote without
# one, ``TOPICS`` by name) says where it goes.
GROUPS = {
    "run": "run.py: every system side by side",
    "memory": "Memory per rank against the ZeRO formulas",
    "step-time": "Step time",
    "activations": "Activation checkpointing",
    "cpu-offload": "CPU offload and the compiled CPU optimizers",
    "nvme": "NVMe offload",
    "checkpoints": "Checkpoints",
    "parallel": "Tensor and pipeline parallelism",
    "gpu": "GPU",
    "tests": "Test suite",
}
TOPICS = {"quick": "run", "parallel3d": "parallel", "parallel3d_quick": "parallel"}
# Files written by scripts that do not record their own command line.
COMMANDS = {
    "quick": "python benchmarks/run.py --quick",
    "parallel3d": "python benchmarks/parallel3d.py",
    "parallel3d_quick": "python benchmarks/parallel3d.py --quick",
}
TITLES = {
    "quick": "run.py --quick: the latest run, every system (JSON as run.py writes it)",
    "parallel3d": "parallel3d.py: step time per layout and the pipeline bubble",
    "parallel3d_quick": "parallel3d.py --quick: step time per layout and the pipeline bubble",
}
MACHINE_KEYS = ["cpu", "isa", "cores", "gpu", "ranks", "torch", "lightning", "python", "lightning_zero", "date"]


def _topic(stem: str, data: dict[str, Any]) -> str:
    return str(data.get("topic") or TOPICS.get(stem, "other"))


def _table(headers: list[Any], rows: list[list[Any]]) -> str:
    def cell(x: Any) -> str:
        return "-" if x is None else str(x).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_result(stem: str, data: dict[str, Any]) -> str:
    """One result file as a Markdown section: title, command, machine, table(s), notes."""
    out = [f"### {data.get('title') or TITLES.get(stem, stem)}", ""]
    command = " ".join(str(data.get("command") or COMMANDS.get(stem, "not recorded")).split())
    out.append(f"**Command:** `{command}`  ")
    machine = data.get("machine", {})
    parts = [f"{k}: {machine[k]}" for k in MACHINE_KEYS if machine.get(k)]
    parts += [f"{k}: {v}" for k, v in machine.items() if k not in MACHINE_KEYS and v]
    out.append(f"**Machine and versions:** {'; '.join(parts) or 'not recorded'}  ")
    out.append(f"**Data:** `benchmarks/results/{stem}.json`")
    out.append("")
    if data.get("headers"):
        out += [_table(data["headers"], data.get("rows", [])), ""]
    if isinstance(data.get("table"), str):
        out += [data["table"].strip(), ""]
    for name, table in (data.get("tables") or {}).items():
        out += [f"**{name}**", "", table.strip(), ""]
    for note in data.get("notes", []):
        out += [textwrap.dedent(note).strip(), ""]
    return "\n".join(out)


def render_all(results: Path = RESULTS) -> str:
    """Every result file, grouped by topic in the order of ``GROUPS``; within a topic the files with a
    table first, then notes only, each by file name."""
    order = list(GROUPS)
    entries = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        topic = _topic(path.stem, data)
        rank = order.index(topic) if topic in order else len(order)
        has_table = bool(data.get("headers") or data.get("table") or data.get("tables"))
        entries.append((rank, not has_table, path.stem, topic, data))
    out, current = [], None
    for _, _, stem, topic, data in sorted(entries, key=lambda e: e[:3]):
        if topic != current:
            out += [f"## {GROUPS.get(topic, topic.capitalize())}", ""]
            current = topic
        out.append(render_result(stem, data))
    return "\n".join(out)


def on_files(files: Files, config: Any) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"img/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, render_all())
    return markdown
