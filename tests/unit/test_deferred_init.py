"""The stage-3 construction recorder on one process: a model built under ``Recorder`` and replayed
tensor by tensor equals the same code run unsharded with the same seed, bit for bit, for every way
models initialize themselves, and leaves the random generator where the unsharded build leaves it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.zero.build import materialize
from lightning_zero.zero.deferred import Recorder

CPU = torch.device("cpu")


class InitStyles(nn.Module):
    """Every init style the sharded build must reproduce, with odd shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 7, padding_idx=2)  # reset_parameters + the padding row
        self.lin = nn.Linear(7, 5)
        self.ln = nn.LayerNorm(5)
        self.head = nn.Linear(7, 13, bias=False)
        self.head.weight = self.emb.weight  # tied after both were initialized
        self.late = nn.Parameter(torch.empty(3, 9))  # torch.empty, filled below
        self.view_init = nn.Parameter(torch.empty(4, 6))
        self.register_buffer("mask", torch.tril(torch.ones(6, 6)))  # computed buffers
        inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        self.register_buffer("rotary", torch.outer(torch.arange(6).float(), inv).cos())
        for m in self.modules():  # an init loop after the submodules exist, with data-dependent sampling
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
        with torch.no_grad():
            self.late.normal_()
            self.late[1].mul_(3)  # an in-place edit of a row
            self.emb.weight.data[2].zero_()  # through .data
            nn.init.orthogonal_(self.view_init[:, :4])  # a view, by a function that skips meta tensors
            self.view_init[:, 4:].uniform_(-1, 1)
        self.apply(self._init)  # nanoGPT style

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.LayerNorm):
            module.weight.data.fill_(0.5)
            nn.init.normal_(module.bias, std=0.1)


def _hf_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=16)
    return transformers.GPT2LMHeadModel(config)  # initializes in post_init(), ties wte and lm_head


def _hf_bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=48, vocab_size=97
    )
    return transformers.BertForMaskedLM(config)


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers())
    return out


@pytest.mark.parametrize("build", [InitStyles, _hf_gpt2, _hf_bert], ids=["init-styles", "hf-gpt2", "hf-bert"])
def test_replay_equals_unsharded_build(build):
    torch.manual_seed(5)
    reference = build()
    draws_after = torch.rand(4)
    torch.manual_seed(5)
    with Recorder(CPU) as recording:
        model = build()
    # The generator advanced exactly as in the unsharded build (the next draws are the same).
    assert torch.equal(torch.rand(4), draws_after)
    expected = _tensors(reference)
    for name, tensor in _tensors(model).items():
        assert tensor.is_meta, name
        assert recording.initialized(tensor), name
        assert torch.equal(recording.materialize(tensor), expected[name]), name  # bit for bit


def test_materialize_module_by_module_keeps_ties():
    torch.manual_seed(1)
    reference = InitStyles()
    torch.manual_seed(1)
    with Recorder(CPU) as recording:
        model = InitStyles()
    for name, module in model.named_modules():
        materialize(name, module, CPU, (recording,))
    assert model.head.weight is model.emb.weight
    for name, tensor in _tensors(model).items():
        assert torch.equal(tensor, _tensors(reference)[name]), name


def test_never_written_parameter_is_an_error():
    class Empty(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(5, 3))

    with Recorder(CPU) as recording:
        model = Empty()
    with pytest.raises(ValueError, match="weight of module <root> .*nothing ever wrote"):
        materialize("", model, CPU, (recording,))


def test_reset_parameters_initializes_what_nothing_wrote():
    class Later(nn.Module):  # FSDP-style: reset_parameters exists but __init__ does not call it
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(5, 3))

        def reset_parameters(self) -> None:
            nn.init.constant_(self.weight, 0.25)

    with Recorder(CPU) as recording:
        model = Later()
    materialize("", model, CPU, (recording,))
    assert torch.equal(model.weight, torch.full((5, 3), 0.25))


def test_explicit_generator_is_refused():
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="generator"), Recorder(CPU):
        layer = nn.Linear(4, 4)
        layer.weight.data.normal_(generator=generator)


def _saved_gpt2(tmp_path, **save_kwargs):
    torch.manual_seed(9)
    source = _hf_gpt2()
    source.save_pretrained(tmp_path, **save_kwargs)
    return {k: v.clone() for k, v in source.state_dict().items()}


@pytest.mark.parametrize("layout", ["safetensors", "sharded-index", "torch-file"])
def test_load_pretrained_replays_from_the_file(tmp_path, layout):
    from lightning_zero import load_pretrained

    if layout == "torch-file":
        expected = _saved_gpt2(tmp_path)
        path = tmp_path / "weights.pt"
        torch.save(expected, path)
    else:
        # 20 kB shards: several files and a model.safetensors.index.json
        expected = _saved_gpt2(tmp_path, **({"max_shard_size": "20kB"} if layout == "sharded-index" else {}))
        path = tmp_path
        assert (tmp_path / "model.safetensors.index.json").exists() == (layout == "sharded-index")
    torch.manual_seed(0)  # other initial weights than the saved ones
    with Recorder(CPU) as recording:
        model = _hf_gpt2()
        result = load_pretrained(model, path)
    assert not (result.missing or result.unexpected or result.mismatched)
    for name, tensor in model.state_dict().items():
        assert torch.equal(recording.materialize(tensor), expected[name]), name


def test_load_pretrained_into_a_real_model_and_key_errors(tmp_path):
    from lightning_zero import load_pretrained

    expected = _saved_gpt2(tmp_path)
    model = _hf_gpt2()
    load_pretrained(model, tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    partial = {k: v for k, v in expected.items() if k != "transformer.h.1.mlp.c_fc.weight"}
    partial["extra.weight"] = torch.zeros(2)
    partial["transformer.wpe.weight"] = torch.zeros(3, 32)
    torch.save(partial, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match=r"1 missing: transformer.h.1.mlp.c_fc.weight.*1 unexpected: extra.weight"):
        load_pretrained(_hf_gpt2(), tmp_path / "partial.pt")
    result = load_pretrained(_hf_gpt2(), tmp_path / "partial.pt", strict=False)
    assert result.missing == ["transformer.h.1.mlp.c_fc.weight"] and result.unexpected == ["extra.weight"]
    assert result.mismatched == ["transformer.wpe.weight: file (3, 32) vs model (16, 32)"]
