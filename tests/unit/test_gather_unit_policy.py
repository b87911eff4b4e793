"""Stage 3's gather-unit policy (which modules gather their whole subtree) and its option, without
processes."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_zero.config import ZeroConfig
from lightning_zero.zero.units import gather_units


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 5)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(6, nhead=2, dim_feedforward=7, batch_first=True)
        self.rnn = nn.GRU(6, 6)
        self.blocks = nn.ModuleList([Block(), Block()])


def _names(model: nn.Module, extra: tuple = ()) -> set[str]:
    units = gather_units(model, extra)
    return {name for name, m in model.named_modules() if id(m) in units}


def test_default_units_are_attention_and_rnns():
    assert _names(Net()) == {"encoder.self_attn", "rnn"}


def test_named_units_by_class_class_name_and_pattern():
    model = Net()
    assert _names(model, (Block,)) >= {"blocks.0", "blocks.1"}
    assert _names(model, ("Block",)) >= {"blocks.0", "blocks.1"}
    assert _names(model, ("blocks.1",)) == {"encoder.self_attn", "rnn", "blocks.1"}
    assert _names(model, ("blocks.*",)) >= {"blocks.0", "blocks.1", "blocks.0.fc"}


def test_hugging_face_no_split_modules_and_peft_lora_layers():
    class T5Block(Block):
        pass

    class Pretrained(nn.Module):
        _no_split_modules = ["T5Block"]

        def __init__(self) -> None:
            super().__init__()
            self.block = T5Block()

    # peft's base class, matched by module and name (peft need not be installed)
    lora_base = type("LoraLayer", (), {"__module__": "peft.tuners.lora.layer"})
    lora_linear = type("Linear", (nn.Module, lora_base), {"__module__": "peft.tuners.lora.layer"})
    wrapper = nn.Module()
    wrapper.model = Pretrained()
    wrapper.lora = lora_linear()
    assert _names(wrapper) == {"model.block", "lora"}


def test_a_unit_that_matches_nothing_is_refused():
    with pytest.raises(ValueError, match=r"gather_units=\['Nope', 'x.\*'\] match no module of the model \(Net\)"):
        gather_units(Net(), ("Nope", "x.*", Block))


@pytest.mark.parametrize("bad", [[1], [""], [int], "Block"])
def test_gather_units_option_is_validated(bad):
    with pytest.raises(ValueError, match="gather_units="):
        ZeroConfig(stage=3, gather_units=bad)


def test_gather_units_option_is_a_tuple():
    assert ZeroConfig(stage=3, gather_units=[Block, "x"]).gather_units == (Block, "x")
