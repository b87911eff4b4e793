"""Fixtures of the recipe tests: one token cache for the session, so each corpus is tokenized once."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A session-wide token cache folder (Shakespeare tokenized once per tokenizer)."""
    return tmp_path_factory.mktemp("tokens")
