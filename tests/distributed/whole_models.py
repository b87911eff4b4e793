"""Moved to :mod:`tests.helpers.whole_models`; re-exported for tests that import ``whole_models``."""

from tests.helpers.whole_models import *  # noqa: F403 - the old import path, re-exported whole
