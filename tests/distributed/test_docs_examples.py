"""Every Python example of README.md and docs/*.md runs, so that an example cannot rot.

Blocks fenced as ```` ```python ```` run; a block marked ```` ```python {.fragment} ```` is a piece of a
larger program (a method body, a line that needs your model) and is only compiled. The blocks of one
page run in order in one namespace, as a reader types them into one session, in 2 CPU/gloo ranks
started the way ``torchrun`` starts them (``lightning_zero.testing.run_ranks``): a Trainer example
uses ``accelerator="cpu", devices=2`` there. Each page gets its own working directory.

```` ```yaml ```` blocks that configure a strategy (``trainer.strategy.class_path``) are loaded the way
LightningCLI loads them and the strategy is built from them.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from lightning_zero.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)\s*(.*)$")


@dataclass(frozen=True)
class Block:
    path: str
    line: int
    lang: str
    attrs: str
    source: str

    @property
    def fragment(self) -> bool:
        return ".fragment" in self.attrs


def code_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The fenced code blocks of a Markdown file, with their language and attributes."""
    blocks, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        ticks, start, body = m.group(1), i + 1, []
        i += 1
        while i < len(lines) and lines[i].strip() != ticks:
            body.append(lines[i])
            i += 1
        indent = min((len(b) - len(b.lstrip()) for b in body if b.strip()), default=0)
        source = "\n".join(b[indent:] for b in body) + "\n"
        blocks.append(Block(str(path.relative_to(root)), start, m.group(2).lower(), m.group(3), source))
        i += 1
    return blocks


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_pages() -> dict[str, list[Block]]:
    pages = {}
    for path in doc_files():
        blocks = [b for b in code_blocks(path) if b.lang in ("python", "py")]
        if blocks:
            pages[str(path.relative_to(ROOT))] = blocks
    return pages


def _run_pages(rank: int, pages: dict[str, list[Block]], workdir: str) -> list[str]:
    import os

    failures = []
    for page, blocks in pages.items():
        where = Path(workdir) / page.replace("/", "_")
        where.mkdir(parents=True, exist_ok=True)
        os.chdir(where)
        namespace: dict = {"__name__": "__docs_example__"}
        for block in blocks:
            code = compile(block.source, f"{block.path}:{block.line}", "exec")
            if block.fragment:
                continue
            try:
                exec(code, namespace)
            except BaseException:  # noqa: BLE001 - reported with the block's place
                failures.append(f"rank {rank}, {block.path}:{block.line}:\n{traceback.format_exc()}")
                break  # the page's later blocks build on this one
    return failures


def test_the_fence_parser(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nx = 1\n```\n\n- item\n\n  ```python {.fragment}\n  y.z()\n  ```\n\n```yaml\na: 1\n```\n"
    )
    blocks = code_blocks(page, root=tmp_path)
    assert [(b.lang, b.fragment, b.source) for b in blocks] == [
        ("python", False, "x = 1\n"),
        ("python", True, "y.z()\n"),
        ("yaml", False, "a: 1\n"),
    ]


def test_every_fragment_compiles():
    for blocks in python_pages().values():
        for block in blocks:
            compile(block.source, f"{block.path}:{block.line}", "exec")


@pytest.mark.distributed
def test_python_examples_run_on_two_ranks(tmp_path):
    pages = python_pages()
    assert sum(not b.fragment for blocks in pages.values() for b in blocks) >= 10, "the docs lost their examples"
    results = run_ranks(_run_pages, pages, str(tmp_path), timeout=600)
    failures = [f for res in results for f in res]
    assert not failures, "\n".join(failures)


def test_yaml_strategy_examples_build():
    import yaml
    from jsonargparse import ArgumentParser

    import lightning_zero  # noqa: F401 - registers the strategies

    checked = 0
    for path in doc_files():
        for block in code_blocks(path):
            if block.lang not in ("yaml", "yml") or block.fragment:
                continue
            config = yaml.safe_load(block.source)
            strategy = (config or {}).get("trainer", {}).get("strategy") if isinstance(config, dict) else None
            if not isinstance(strategy, dict) or "class_path" not in strategy:
                continue
            parser = ArgumentParser()
            parser.add_argument("--strategy", type=lightning_zero.ZeroStrategy)
            parsed = parser.parse_object({"strategy": strategy})
            # jsonargparse 4.49 renamed instantiate_classes to instantiate
            build = getattr(parser, "instantiate", None) or parser.instantiate_classes
            built = build(parsed)
            assert isinstance(built.strategy, lightning_zero.ZeroStrategy), f"{block.path}:{block.line}"
            checked += 1
    assert checked >= 1, "no LightningCLI YAML example found"
