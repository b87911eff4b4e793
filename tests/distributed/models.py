"""Moved to :mod:`tests.helpers.models` and :mod:`tests.helpers.trainer`; this module re-exports the
old names so that ``from models import ...`` in tests written before keeps working. New tests import
from ``tests.helpers``."""

from tests.helpers.models import (  # noqa: F401 - re-exported
    HIDDEN,
    SEQ,
    VOCAB,
    WIDTH,
    BuiltInConfigureModel,
    CountingAdamW,
    HazardModel,
    ManualParityModel,
    ParityModel,
    StateEveryStep,
    make_loader,
    state,
)
from tests.helpers.trainer import build_strategy, fit  # noqa: F401 - re-exported
