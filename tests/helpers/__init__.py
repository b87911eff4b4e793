"""What the tests share, imported the ordinary way (``from tests.helpers import ...``; pyproject's
pytest ``pythonpath`` puts the repository root on ``sys.path``, and spawned ranks inherit it).

* :mod:`tests.helpers.parity`: :func:`max_rel`, :func:`norm_rel` and why the tolerances are what
  they are;
* :mod:`tests.helpers.trainer`: the quiet Trainer (:data:`QUIET`, :func:`quiet_trainer`) and the
  parity run :func:`fit`;
* :mod:`tests.helpers.models`: :class:`ParityModel` (odd shapes, tied, frozen and unused weights,
  two parameter groups) and its variants, :func:`make_loader`, :func:`state`;
  :mod:`tests.helpers.unit_models` (cross-module parameter reads, HF T5, PEFT LoRA),
  :mod:`tests.helpers.whole_models` (whole-tensor optimizers), :mod:`tests.helpers.gpt_reference`
  (the one-process GPT-2 run of the model-parallel tests);
* :mod:`tests.helpers.checkpoint`, :mod:`tests.helpers.fabric`, :mod:`tests.helpers.workers`:
  models, loaders and rank workers that several test files run;
* :mod:`tests.helpers.cuda`: the model and Trainer of the GPU tests;
* :func:`run_ranks` (from :mod:`lightning_zero.testing`): spawning the ranks.

Fixtures are in tests/conftest.py.
"""

from lightning_zero.testing import free_port, run_ranks
from tests.helpers.models import VOCAB, ParityModel, make_loader, state
from tests.helpers.parity import max_rel, norm_rel
from tests.helpers.trainer import NO_VALIDATION, QUIET, build_strategy, fit, quiet_trainer

__all__ = [
    "NO_VALIDATION",
    "QUIET",
    "VOCAB",
    "ParityModel",
    "build_strategy",
    "fit",
    "free_port",
    "make_loader",
    "max_rel",
    "norm_rel",
    "quiet_trainer",
    "run_ranks",
    "state",
]
