"""Every invalid option of ZeroStrategy, LossScaleConfig and OffloadPrecision, one row each: the
constructor raises a ValueError whose message names the bad value (and, per docs/options.md, "Options"
list of checks, what to use instead). No process group is needed: all of it fails at construction."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from lightning_zero import LossScaleConfig, OffloadPrecision, ZeroStrategy
from lightning_zero.debug import ENV_VAR

STRATEGY_ROWS = [
    # stage
    ({"stage": 0}, "strategy='ddp'"),
    ({"stage": 4}, "stage=4 is not a ZeRO stage; choose 1, 2 or 3"),
    ({"stage": -1}, "stage=-1"),
    ({"stage": True}, "stage=True"),
    ({"stage": "2"}, "stage='2'"),
    ({"stage": 2.0}, "stage=2.0"),
    # sizes in elements: positive integers
    ({"reduce_bucket_size": 0}, "reduce_bucket_size=0 must be a positive number of elements"),
    ({"reduce_bucket_size": -5}, "reduce_bucket_size=-5"),
    ({"reduce_bucket_size": 2.5}, "reduce_bucket_size=2.5 must be a positive number of elements .* a whole number"),
    ({"reduce_bucket_size": True}, "reduce_bucket_size=True"),
    ({"allgather_bucket_size": 0}, "allgather_bucket_size=0"),
    ({"allgather_bucket_size": "50M"}, "allgather_bucket_size='50M'"),
    ({"prefetch_bucket_size": 0}, "prefetch_bucket_size=0"),
    ({"prefetch_bucket_size": -1}, "prefetch_bucket_size=-1"),
    ({"host_mmap_threshold": 0}, "host_mmap_threshold=0"),
    ({"reduce_dtype": "fp8"}, "reduce_dtype='fp8' is not a gradient dtype"),
    ({"reduce_dtype": 32}, "reduce_dtype=32"),
    ({"host_mmap_threshold": "1M"}, "host_mmap_threshold='1M'"),
    ({"host_mmap_threshold": True}, "host_mmap_threshold=True"),
    ({"expose_param_grads": "manual"}, "expose_param_grads='manual'"),
    ({"max_live_parameters": 0}, "max_live_parameters=0"),
    ({"max_live_parameters": 1.5}, "max_live_parameters=1.5"),
    ({"param_persistence_threshold": -1}, "param_persistence_threshold=-1 must be an integer >= 0"),
    ({"param_persistence_threshold": 1.5}, "param_persistence_threshold=1.5"),
    ({"param_persistence_threshold": True}, "param_persistence_threshold=True"),
    # switches
    ({"overlap_comm": "yes"}, "overlap_comm='yes' must be True or False"),
    ({"overlap_comm": 1}, "overlap_comm=1"),
    ({"allow_untested_optimizer": "no"}, "allow_untested_optimizer='no'"),
    ({"debug_collectives": "1"}, "debug_collectives='1' must be True or False"),
    ({"debug_collectives": 1}, "debug_collectives=1"),
    # collective timeout: a positive timedelta or number of seconds
    ({"timeout": 0}, "timeout=0 must be positive"),
    ({"timeout": -5.0}, "timeout=-5.0 must be positive"),
    ({"timeout": timedelta(0)}, r"timeout=datetime.timedelta\(0\) must be positive"),
    ({"timeout": "10m"}, "timeout='10m' must be a datetime.timedelta or a number of seconds"),
    ({"timeout": math.inf}, "timeout=inf must be a datetime.timedelta"),
    ({"timeout": True}, "timeout=True"),
    # offload
    ({"stage": 2, "offload_optimizer": True, "offload_parameters": True}, "needs stage=3"),
    ({"stage": 3, "offload_parameters": True}, "offload_parameters=True needs offload_optimizer=True"),
]


@pytest.mark.parametrize("kwargs,match", STRATEGY_ROWS, ids=[repr(k) for k, _ in STRATEGY_ROWS])
def test_invalid_strategy_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)


LOSS_SCALE_ROWS = [
    ({"initial_scale": 0}, "initial_scale=0 must be > 0"),
    ({"initial_scale": -1.0}, "initial_scale=-1.0"),
    ({"initial_scale": math.inf}, "initial_scale=inf must be a finite number"),
    ({"initial_scale": math.nan}, "initial_scale=nan must be a finite number"),
    ({"initial_scale": "65536"}, "initial_scale='65536'"),
    ({"initial_scale": True}, "initial_scale=True"),
    ({"growth_factor": 1.0}, "growth_factor=1.0 must be > 1"),
    ({"growth_factor": 0.5}, "growth_factor=0.5"),
    ({"growth_factor": math.inf}, "growth_factor=inf"),
    ({"backoff_factor": 0}, r"backoff_factor=0 must be in \(0, 1\)"),
    ({"backoff_factor": 1.0}, "backoff_factor=1.0"),
    ({"backoff_factor": 1.5}, "backoff_factor=1.5"),
    ({"backoff_factor": math.nan}, "backoff_factor=nan"),
    ({"growth_interval": 0}, "growth_interval=0 must be >= 1"),
    ({"growth_interval": 1.5}, "growth_interval=1.5 must be a whole number of steps"),
    ({"growth_interval": True}, "growth_interval=True"),
    ({"min_scale": 0}, "min_scale=0 must be in"),
    ({"min_scale": -1.0}, "min_scale=-1.0"),
    ({"min_scale": 10.0, "initial_scale": 2.0}, r"min_scale=10.0 must be in \(0, initial_scale=2.0\]"),
]


@pytest.mark.parametrize("kwargs,match", LOSS_SCALE_ROWS, ids=[repr(k) for k, _ in LOSS_SCALE_ROWS])
def test_invalid_loss_scale_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaleConfig(**kwargs)


PRECISION_ROWS = [
    ({"precision": "16-true"}, "'16-mixed'"),
    ({"precision": "transformer-engine"}, "precision='transformer-engine'"),
    ({"precision": "8"}, "precision='8'"),
    ({"precision": 65}, "precision=65"),
    ({"precision": None}, "precision=None"),
    ({"precision": "bf16-true", "offload_optimizer": True}, "use precision='bf16-mixed'"),
    ({"precision": "64-true", "offload_optimizer": True}, "use offload_optimizer=False for float64"),
    ({"offload_parameters": True}, "offload_parameters=True needs offload_optimizer=True"),
]


@pytest.mark.parametrize("kwargs,match", PRECISION_ROWS, ids=[repr(k) for k, _ in PRECISION_ROWS])
def test_invalid_precision_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffloadPrecision(**kwargs)


@pytest.mark.parametrize("value", ["maybe", "2", "enable"])
def test_invalid_debug_environment_variable(monkeypatch, value):
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(ValueError, match=f"{ENV_VAR}='{value}' is not a switch"):
        ZeroStrategy()


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("0", False), ("", False)])
def test_debug_environment_variable(monkeypatch, value, expected):
    monkeypatch.setenv(ENV_VAR, value)
    assert ZeroStrategy().failure_config.debug_collectives is expected
    assert ZeroStrategy(debug_collectives=not expected).failure_config.debug_collectives is (not expected)


def test_timeout_default_and_seconds():
    assert ZeroStrategy().failure_config.timeout == timedelta(minutes=10)
    assert ZeroStrategy(timeout=90).failure_config.timeout == timedelta(seconds=90)
    assert ZeroStrategy(timeout=timedelta(hours=1))._timeout == timedelta(hours=1)  # what DDPStrategy passes on
