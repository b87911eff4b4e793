"""Moved to :mod:`tests.helpers.gpt_reference`; re-exported for tests that import ``gpt_reference``."""

from tests.helpers.gpt_reference import *  # noqa: F403 - the old import path, re-exported whole
