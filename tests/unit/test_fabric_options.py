"""Fabric's ZeroStrategy without processes: its names in Fabric's registry, the options it
shares with the Trainer strategy, the precision plugin Fabric gets, and Fabric's ThroughputMonitor dtype."""

from __future__ import annotations

import inspect

import docstring_parser
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.utilities.throughput import _plugin_to_compute_dtype

import lightning_zero
from lightning_zero import OffloadPrecision
from lightning_zero.config import StrategyConfig
from lightning_zero.fabric import FabricOffloadPrecision, ZeroStrategy
from lightning_zero.options import OPTIONS, REGISTERED_NAMES, STRATEGY_OPTIONS, check_signature, strategy_config
from lightning_zero.strategy import LIGHTNING_ARGUMENTS


@pytest.mark.parametrize("name", sorted(REGISTERED_NAMES))
def test_fabric_finds_the_registered_names(name):
    fabric = Fabric(accelerator="cpu", devices=1, strategy=name)
    strategy = fabric.strategy
    assert type(strategy) is ZeroStrategy
    expected = REGISTERED_NAMES[name][1]
    assert strategy.config.zero.stage == expected["stage"]
    assert strategy.config.offload.offload_optimizer == expected.get("offload_optimizer", False)
    assert bool(strategy.config.offload.offload_parameters) == expected.get("offload_parameters", False)


def test_options_are_written_once():
    """The options are the config fields declared with option(): strategy_config's signature is
    derived from them, the Trainer strategy's explicit one was checked against them at import, and its
    docstring (read by LightningCLI's help) has one entry per option from the field's docstring."""
    names = [option.name for option in OPTIONS]
    assert len(names) == len(set(names)) == len(STRATEGY_OPTIONS)
    assert list(inspect.signature(strategy_config).parameters) == [*names, "ddp_kwargs"]
    trainer = inspect.signature(lightning_zero.ZeroStrategy.__init__).parameters
    assert set(trainer) - set(names) == {"self", "ddp_kwargs", *LIGHTNING_ARGUMENTS}
    documented = {p.arg_name for p in docstring_parser.parse(lightning_zero.ZeroStrategy.__doc__ or "").params}
    assert set(names) <= documented
    assert all(option.doc for option in OPTIONS), [o.name for o in OPTIONS if not o.doc]
    # the defaults build the defaults of every section (None-valued keywords decide at construction)
    assert strategy_config() == StrategyConfig()


def _signature(stage: int = 2, reduce_bucket_size: int | float | str = "auto", *, loss_scale=None, **options):
    """A strategy signature with two options, as Fabric's takes them (the rest through ``**options``)."""


def _wrong_default(stage: int = 3, *, loss_scale=None, **options):
    """``stage`` with another default than its field's."""


def _wrong_type(stage: float = 2, *, loss_scale=None, **options):
    """``stage`` annotated otherwise."""


def _unknown(stage: int = 2, *, stages=None, **options):
    """a name that is neither an option nor the strategy's own."""


@pytest.mark.parametrize(
    "function,match",
    [
        (_wrong_default, r"stage=3, but the option's default is 2"),
        (_wrong_type, r"stage: float, but the option is int"),
        (_unknown, r"'stages' is neither an option nor one of its own arguments"),
    ],
)
def test_a_signature_out_of_step_raises(function, match):
    check_signature(_signature, ["loss_scale"], every_option=False)  # in step
    with pytest.raises(TypeError, match=match):
        check_signature(function, ["loss_scale"], every_option=False)
    with pytest.raises(TypeError, match="option 'allgather_bucket_size' is missing"):
        check_signature(_signature, ["loss_scale"])  # the Trainer's must name every option


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"stage": 4}, "stage=4"),
        ({"reduce_bucket_size": 0}, "reduce_bucket_size=0"),
        ({"stage": 2, "offload_parameters": True, "offload_optimizer": True}, "needs stage=3"),
        ({"pipeline_parallel_size": 2}, "data parallel only"),
        ({"state_dict_type": "whole"}, "state_dict_type='whole'"),
        ({"async_save": True}, "async_save=True"),
        ({"node_local_storage": True}, "node_local_storage=True"),
        ({"node_local_storage": True, "state_dict_type": "full"}, "rank 0 assembles from every rank's shards"),
        ({"node_local_storage": "yes"}, "must be True or False"),
    ],
)
def test_invalid_options_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)


@pytest.mark.parametrize(
    "precision,dtype",
    [
        ("32-true", torch.float32),
        ("bf16-mixed", torch.bfloat16),
        ("bf16-true", torch.bfloat16),
        ("64-true", torch.float64),
    ],
)
def test_fabric_precision_and_throughput_dtype(precision, dtype):
    fabric = Fabric(accelerator="cpu", devices=1, strategy="zero3", precision=precision)
    plugin = fabric.strategy.precision
    assert isinstance(plugin, FabricOffloadPrecision) and plugin.precision == precision
    assert fabric._precision is plugin  # what Fabric's model wrapper calls
    # Fabric's ThroughputMonitor measures MFU against the peak of this dtype
    assert _plugin_to_compute_dtype(plugin) == dtype


def test_offload_precision_plugin_keeps_its_options():
    plugin = OffloadPrecision("bf16-mixed", offload_optimizer=True)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=2), plugins=[plugin])
    converted = fabric.strategy.precision
    assert isinstance(converted, FabricOffloadPrecision)
    assert converted.precision == "bf16-mixed" and converted.offload.offload_optimizer


def test_outputs_in_the_default_dtype():
    plugin = FabricOffloadPrecision("bf16-mixed")
    out = plugin.convert_output({"loss": torch.ones(2, dtype=torch.bfloat16), "ids": torch.ones(2, dtype=torch.long)})
    assert out["loss"].dtype == torch.float32 and out["ids"].dtype == torch.long
    module = torch.nn.Linear(3, 2)
    assert plugin.convert_module(module).weight.dtype == torch.float32  # cast later, after the engine
    assert plugin.cast_module(module).weight.dtype == torch.bfloat16
