"""Moved to :mod:`tests.helpers.unit_models`; re-exported for tests that import ``unit_models``."""

from tests.helpers.unit_models import *  # noqa: F403 - the old import path, re-exported whole
